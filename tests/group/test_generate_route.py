"""The engine client's token route (per-token versions from the engine's spans) and its continuation of samples
an ``abort`` push ended, against fake engines answering as vLLM 0.32 does."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import numpy as np
import pytest

from rollhub.inference import openai_client
from rollhub.inference.base import SamplingParams
from rollhub.inference.openai_client import GENERATE_PATH, InferenceError, OpenAICompletionsClient

PARAMS = SamplingParams(max_tokens=6, temperature=1.0)


class Engine:
    """Answers ``/tokenize`` (one id per character) and ``/inference/v1/generate`` from ``script``: a list of
    ``(tokens, finish, spans)`` answers, one per choice, in order of asking; records every request body."""

    def __init__(self, script: list[tuple[list[int], str, Any]]) -> None:
        self.script = list(script)
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append({"path": request.url.path, **body})
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [100 + ord(c) % 50 for c in body["prompt"]]})
        assert request.url.path == GENERATE_PATH
        choices = []
        for i in range(body["sampling_params"]["n"]):
            tokens, finish, spans = self.script.pop(0)
            content = [{"token": f"t{t}", "logprob": -0.1 * t, "bytes": None, "top_logprobs": []} for t in tokens]
            text = "".join(chr(97 + t % 26) for t in tokens)
            choices.append({"index": i, "token_ids": tokens, "text": text, "finish_reason": finish,
                            "logprobs": {"content": content}, "weight_versions": spans})  # fmt: skip
        return httpx.Response(200, json={"choices": choices, "prompt_token_ids": body["token_ids"]})


def _client(engine: Any, **kwargs: Any) -> OpenAICompletionsClient:
    return OpenAICompletionsClient("http://engine", "tiny", send_seed=False, max_retries=0,
                                   transport=httpx.MockTransport(engine), **kwargs)  # fmt: skip


def span(version: str, start: int, end: int) -> dict[str, Any]:
    return {"version": version, "start": start, "end": end}


def test_the_token_route_gives_each_token_the_version_that_sampled_it() -> None:
    engine = Engine([
        ([1, 2, 3, 4, 5], "stop", [span("3", 0, 2), span("4", 2, 5)]),  # a push crossed this one after 2 tokens
        ([6, 7], "length", [span("4", 0, 2)]),
        ([8], "stop", [span("4", 0, 1)]),
        ([9, 10], "stop", [span("default", 0, 2)]),  # before any push: no rollhub version
    ])  # fmt: skip
    out = _client(engine, route="generate").complete(["ab", "c"], 2, PARAMS, np.random.default_rng(0))
    asked = [b for b in engine.bodies if b["path"] == GENERATE_PATH]
    assert sorted(tuple(b["token_ids"]) for b in asked) == [(147, 148), (149,)]  # tokenized by the engine
    assert all(b["sampling_params"]["logprobs"] == 0 and b["sampling_params"]["n"] == 2 for b in asked)
    assert all(b["sampling_params"]["max_tokens"] == 6 and b["output_mode"] == "text" for b in asked)
    flat = [c for row in out for c in row]
    assert sorted(c.tokens for c in flat) == [(1, 2, 3, 4, 5), (6, 7), (8,), (9, 10)]
    by_tokens = {c.tokens: c for c in flat}
    assert by_tokens[(1, 2, 3, 4, 5)].versions == (3, 3, 4, 4, 4)
    assert by_tokens[(6, 7)].versions == (4, 4) and by_tokens[(6, 7)].finish_reason == "length"
    assert by_tokens[(9, 10)].versions is None
    assert by_tokens[(1, 2, 3, 4, 5)].logprobs == pytest.approx((-0.1, -0.2, -0.3, -0.4, -0.5))
    assert all(c.prompt_tokens in ((147, 148), (149,)) for c in flat)


@pytest.mark.parametrize(
    "spans",
    [[span("1", 0, 1)], [span("1", 0, 2), span("2", 1, 2)], [span("x", 0, 2)], [{"version": "1"}], None],
    ids=["short", "overlap", "not-a-version", "no-bounds", "none"],
)
def test_spans_that_do_not_cover_every_token_once_give_no_versions(spans: Any) -> None:
    (row,) = _client(Engine([([1, 2], "stop", spans)]), route="generate").complete([[5]], 1, PARAMS, None)  # type: ignore[arg-type]
    assert row[0].versions is None and row[0].tokens == (1, 2)


def test_an_aborted_sample_is_continued_from_its_tokens_with_their_versions() -> None:
    engine = Engine([
        ([1, 2], "abort", [span("3", 0, 2)]),  # the abort push ended it after 2 tokens
        ([3, 4, 5], "stop", [span("4", 0, 3)]),
    ])  # fmt: skip
    client = _client(engine, route="generate", continue_aborted=True)
    ((done,),) = client.complete([[7, 8]], 1, PARAMS, np.random.default_rng(0))
    assert done.tokens == (1, 2, 3, 4, 5) and done.versions == (3, 3, 4, 4, 4) and done.finish_reason == "stop"
    assert done.prompt_tokens == (7, 8) and done.params == PARAMS and len(done.logprobs) == 5
    assert engine.bodies[1]["token_ids"] == [7, 8, 1, 2]  # continued from the prompt and the tokens so far
    assert engine.bodies[1]["sampling_params"]["max_tokens"] == 4  # the tokens left
    assert client.continuations == 1


def test_continuations_are_bounded() -> None:
    engine = Engine([([1], "abort", [span("1", 0, 1)]), ([2], "abort", [span("2", 0, 1)]), ([3], "abort", None)])
    client = _client(engine, route="generate", continue_aborted=True, max_continues=2)
    ((done,),) = client.complete([[7]], 1, PARAMS, np.random.default_rng(0))
    assert done.tokens == (1, 2, 3) and done.finish_reason == "abort" and done.versions is None
    assert client.continuations == 2


def test_the_samples_an_abort_push_ended_are_continued_together() -> None:
    """A push in ``abort`` mode ends every request in flight at once: their continuations run at the same time
    (here each waits for all the others at the engine, so continuing them one by one breaks the barrier), and
    each lands back in its own prompt's row and place."""
    n_prompts, n = 2, 3
    together = threading.Barrier(n_prompts * n, timeout=60)
    first = threading.Event()

    def engine(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        ids, k = body["token_ids"], body["sampling_params"]["n"]
        if len(ids) == 1:  # a first request: every choice ended by the push after one token, its own
            first.set()
            tokens = [[10 * ids[0] + i] for i in range(k)]
            finish = "abort"
        else:  # a continuation of [prompt, token]: the sample's rest
            together.wait()
            tokens, finish = [[ids[-1] + 1, ids[-1] + 2]], "stop"
        choices = [{"index": i, "token_ids": t, "text": "x" * len(t), "finish_reason": finish,
                    "logprobs": {"content": [{"token": "t", "logprob": -1.0}] * len(t)},
                    "weight_versions": [span("1" if finish == "abort" else "2", 0, len(t))]}
                   for i, t in enumerate(tokens)]  # fmt: skip
        return httpx.Response(200, json={"choices": choices})

    client = _client(engine, route="generate", continue_aborted=True)
    out = client.complete([[1], [2]], n, PARAMS, np.random.default_rng(0))
    assert first.is_set() and client.continuations == n_prompts * n
    assert [[c.tokens for c in row] for row in out] == [[(10, 11, 12), (11, 12, 13), (12, 13, 14)],
                                                         [(20, 21, 22), (21, 22, 23), (22, 23, 24)]]  # fmt: skip
    assert all(c.versions == (1, 2, 2) and c.finish_reason == "stop" for row in out for c in row)


def test_a_sample_aborted_before_its_first_token_is_sent_again_whole() -> None:
    # a request still waiting when the abort push came: nothing sampled, so the whole request runs on the new weights
    engine = Engine([([], "abort", None), ([4, 5], "stop", [span("2", 0, 2)])])
    client = _client(engine, route="generate", continue_aborted=True)
    ((done,),) = client.complete([[7]], 1, PARAMS, np.random.default_rng(0))
    assert done.tokens == (4, 5) and done.finish_reason == "stop" and done.versions == (2, 2)
    assert engine.bodies[-1]["token_ids"] == [7] and engine.bodies[-1]["sampling_params"]["max_tokens"] == 6
    assert client.continuations == 1
    # without continuation it stays aborted (never scored or trained on)
    ((empty,),) = _client(Engine([([], "abort", None)]), route="generate").complete([[7]], 1, PARAMS,
                                                                                  np.random.default_rng(0))  # fmt: skip
    assert empty.tokens == () and empty.finish_reason == "abort"


def test_the_completions_route_continues_an_aborted_choice_too() -> None:
    bodies: list[dict[str, Any]] = []

    def engine(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        tokens, finish = ([1, 2], "abort") if len(bodies) == 1 else ([3], "stop")
        logprobs = {"token_logprobs": [-1.0] * len(tokens)}
        choice = {"index": 0, "text": "x", "finish_reason": finish, "token_ids": tokens,
                  "prompt_token_ids": body["prompt"][0], "logprobs": logprobs}  # fmt: skip
        return httpx.Response(200, json={"choices": [choice]})

    client = _client(engine, continue_aborted=True)
    ((done,),) = client.complete([[9]], 1, PARAMS, np.random.default_rng(0))
    assert done.tokens == (1, 2, 3) and done.finish_reason == "stop" and done.versions is None
    assert bodies[1]["prompt"] == [[9, 1, 2]] and bodies[1]["max_tokens"] == 4


def test_a_choice_without_log_probs_and_an_unknown_route_are_refused() -> None:
    class NoLogprobs(Engine):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            response = super().__call__(request)
            body = response.json()
            body["choices"][0]["logprobs"] = None
            return httpx.Response(200, json=body)

    with pytest.raises(InferenceError, match=r"no logprobs\.content"):
        _client(NoLogprobs([([1], "stop", None)]), route="generate").complete([[1]], 1, PARAMS, None)  # type: ignore[arg-type]
    with pytest.raises(InferenceError, match="route 'chat' is not one of"):
        _client(Engine([]), route="chat")


def test_text_prompts_are_tokenized_in_their_own_threads_and_each_text_once() -> None:
    both_asked = threading.Barrier(2, timeout=60.0)  # a second /tokenize must come while the first waits

    class Concurrent(Engine):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/tokenize" and len(self.bodies) < 2:
                both_asked.wait()
            return super().__call__(request)

    engine = Concurrent([([1], "stop", [span("1", 0, 1)])] * 6)
    client = _client(engine, route="generate")
    first = client.complete(["ab", "c"], 1, PARAMS, np.random.default_rng(0))
    again = client.complete(["c", "ab", "ab"], 1, PARAMS, np.random.default_rng(0))
    assert sorted(b["prompt"] for b in engine.bodies if b["path"] == "/tokenize") == ["ab", "c"]
    assert [row[0].prompt_tokens for row in first] == [(147, 148), (149,)]
    assert [row[0].prompt_tokens for row in again] == [(149,), (147, 148), (147, 148)]


def test_the_kept_tokenizations_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openai_client, "TOKENIZED_PROMPTS", 2)
    engine = Engine([([1], "stop", None)] * 5)
    client = _client(engine, route="generate")
    for prompt in ("a", "b", "c", "a", "c"):  # "c" makes the client forget "a", the oldest; "c" is still kept
        client.complete([prompt], 1, PARAMS, np.random.default_rng(0))
    assert [b["prompt"] for b in engine.bodies if b["path"] == "/tokenize"] == ["a", "b", "c", "a"]
