"""Fakes for the episode tests: a scripted policy over a real tokenizer, and what it handed out."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from rollhub.envs.episode import EnvReply, Episode, ModelTurn, Outcome, Task
from rollhub.inference.base import Completion, SamplingParams


def solver(text: str) -> str:
    """The right agent for the calculator task: calls calc with the operands, then answers with what it returned."""
    if "<tool_response>" not in text:
        a, b = text.split("user: ")[-1].split("=?")[0].split("*")
        return f'<tool_call>{{"name": "calc", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    return text.split("<tool_response>")[-1].split("</tool_response>")[0]


# Qwen3's rule: an assistant turn before the last user message is shown without its <think>...</think> reasoning
REWRITING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{% set c = m['content'] %}"
    "{% if loop.index0 < ns.last_user and '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "assistant: {{ c }}<eos>{{ '\\n' }}"
    "{% elif m['role'] == 'tool' %}tool: <tool_response>{{ m['content'] }}</tool_response>{{ '\\n' }}"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass
class Sampled:
    """One turn the fake engine answered: the prompt ids it was given and the ids and log-probs it returned."""

    prompt: list[int]
    ids: list[int]
    logprobs: list[float]
    max_tokens: int = 0


@dataclass
class ScriptedPolicy:
    """Answers a token-id prompt with ``script(prompt text)`` encoded by the tokenizer, then its stop token, cut at
    ``max_tokens`` as an engine cuts it; log-probs are distinct per call so a test can trace each one.

    ``script`` may return ``None`` for an aborted request. With ``version_of``, each completion reports the version
    that sampled each token, ``version_of(k, i)`` for token ``i`` of the ``k``-th turn handed out (as vLLM's token
    route does).
    """

    tokenizer: Any
    script: Callable[[str], str | None]
    stop_id: int | None = None
    handed_out: list[Sampled] = field(default_factory=list)
    version_of: Callable[[int, int], int] | None = None

    def complete(self, prompts: list[Any], n: int, params: SamplingParams,
                 rng: np.random.Generator) -> list[list[Completion]]:  # fmt: skip
        out = []
        for prompt in prompts:
            ids = list(prompt) if not isinstance(prompt, str) else self.tokenizer(prompt)["input_ids"]
            comps = []
            for _ in range(n):
                text = self.script(self.tokenizer.decode(ids, skip_special_tokens=False))
                if text is None:
                    comps.append(Completion(tuple(ids), (), (), "", "abort", params))
                    continue
                stop = self.tokenizer.eos_token_id if self.stop_id is None else self.stop_id
                sampled = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], stop]
                finish = "stop" if len(sampled) <= params.max_tokens else "length"
                sampled = sampled[: params.max_tokens]
                k = len(self.handed_out)
                logprobs = [-0.01 * (k + 1) - 0.001 * i for i in range(len(sampled))]
                self.handed_out.append(Sampled(ids, sampled, logprobs, params.max_tokens))
                shown = self.tokenizer.decode(sampled, skip_special_tokens=True)
                versions = (
                    None if self.version_of is None else tuple(self.version_of(k, i) for i in range(len(sampled)))
                )
                comps.append(Completion(tuple(ids), tuple(sampled), tuple(logprobs), shown, finish, params, versions))
            out.append(comps)
        return out


def group_rows(*groups: Any) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """``(tokens, mask, inference log-probs)`` of every row of ``groups``."""
    return [(list(map(int, t)), np.asarray(m), np.asarray(lp, np.float64))
            for g in groups for t, m, lp in zip(g.tokens.rows(), g.masks.rows(), g.inference_logprobs.rows(),
                                                strict=True)]  # fmt: skip


def batch_rows(batch: Any) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """The same of a GRPO ``TokenBatch``, read back from what it trains: a position is sampled where
    ``loss_mask`` is 1, and its log-prob is the batch's behaviour log-prob (padding dropped: rows end at their last
    nonzero token or trained position)."""
    rows = []
    for tokens, mask, lp in zip(batch.tokens.numpy(), batch.loss_mask.numpy(), batch.behaviour_logprobs.numpy(),
                                strict=True):  # fmt: skip
        n = int(np.flatnonzero(tokens).max()) + 1 if tokens.any() else 0
        trained = mask[:n] > 0
        rows.append((list(map(int, tokens[:n])), np.where(trained, tokens[:n], -100), np.where(trained, lp[:n], 1.0)))
    return rows


def assert_exact_rows(rows: Any, handed_out: list[Sampled]) -> int:
    """Every sampled span of every row is what the engine returned when prompted with exactly the row before it
    (ids and log-probs), and every other position is masked ``-100`` with log-prob ``1.0``. ``rows`` is a group
    (or a list of :func:`group_rows` / :func:`batch_rows`). Returns the spans seen."""
    if hasattr(rows, "tokens"):
        rows = group_rows(rows)
    spans = 0
    for i, (tokens, mask, lp) in enumerate(rows):
        sampled = mask != -100
        assert np.all(lp[~sampled] == 1.0), f"row {i}: a position not sampled has a log-prob"
        t = 0
        while t < len(tokens):
            if not sampled[t]:
                t += 1
                continue
            end = t
            while end < len(tokens) and sampled[end]:
                end += 1
            match = [s for s in handed_out if s.prompt == tokens[:t] and s.ids == tokens[t:end]
                     and np.allclose(lp[t:end], s.logprobs, rtol=0, atol=1e-6)]  # fmt: skip
            assert match, f"row {i}: the span at {t}:{end} is not what the engine sampled after row[:{t}]"
            assert list(mask[t:end]) == tokens[t:end]
            spans += 1
            t = end
    return spans


@dataclass
class FollowUpEnv:
    """Asks a question, then a follow-up as a new user message; 1 per right answer."""

    name: str = "follow-up"

    def tasks(self, n: int, mode: str, rng: np.random.Generator) -> list[Task]:
        return [Task(f"q{i}", [{"role": "user", "content": "12+34?"}]) for i in range(n)]

    def step(self, task: Task, episode: Episode, turn: ModelTurn) -> EnvReply:
        right = float(turn.text.endswith("46"))
        if turn.index == 0:
            return EnvReply([{"role": "user", "content": "again?"}], reward=right)
        return EnvReply(reward=right, done=True)

    def outcome(self, task: Task, episode: Episode) -> Outcome:
        return Outcome(0.0, correct=sum(episode.turn_rewards) == 2)


class FakeEngine(ThreadingHTTPServer):
    """An OpenAI completions server on 127.0.0.1 answering like vLLM (``token_ids``, ``prompt_token_ids``,
    ``logprobs.token_logprobs``) with a :class:`ScriptedPolicy`; while ``gate`` is clear, requests wait for it."""

    def __init__(self, policy: ScriptedPolicy, model: str = "tiny") -> None:
        super().__init__(("127.0.0.1", 0), _EngineHandler)
        self.policy = policy
        self.model = model
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()  # set while a request waits on the gate
        self.requests: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> FakeEngine:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()
        self.shutdown()
        self.server_close()


def completion_choices(out: list[list[Any]], n: int) -> list[dict[str, Any]]:
    """``/v1/completions`` choices of ``n`` completions per prompt, as vLLM answers them (token ids, prompt ids,
    per-token log-probs)."""
    return [
        {"index": i * n + k, "text": c.text, "token_ids": list(c.tokens),
         "prompt_token_ids": list(c.prompt_tokens), "finish_reason": c.finish_reason,
         "logprobs": {"token_logprobs": list(c.logprobs), "tokens": [f"token_id:{t}" for t in c.tokens]}}
        for i, comps in enumerate(out) for k, c in enumerate(comps)
    ]  # fmt: skip


class _EngineHandler(BaseHTTPRequestHandler):
    server: FakeEngine

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        if not self.server.gate.is_set():
            self.server.waiting.set()
            self.server.gate.wait()
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"])
        out = self.server.policy.complete(body["prompt"], body["n"], params, np.random.default_rng())
        data = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": self.server.model,
                           "choices": completion_choices(out, body["n"])}).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run an ASGI app under uvicorn on a free loopback port in a thread; yields its URL and stops it after."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn exited before it started")
        threading.Event().wait(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()
