"""The OpenAI-compatible client against a small fake completions server on 127.0.0.1 (a real socket)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from rollhub.envs.group.arithmetic import ArithmeticEnv
from rollhub.envs.group.scored import group_info
from rollhub.inference.base import InferenceContext, SamplingParams
from rollhub.inference.openai_client import InferenceError, OpenAICompletionsClient
from rollhub.inference.tokenizer import CharTokenizer
from rollhub.wire.group import group_to_item

TOK = CharTokenizer()


class FakeServer(ThreadingHTTPServer):
    """Answers ``a+b=`` prompts with the sum (zero-padded) then ``<eos>``, the way vLLM formats choices."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.requests: list[dict[str, Any]] = []
        self.fail_next = 0  # answer this many requests with 503 first
        self.style = "token_ids"  # or "strings" (plain token strings, no ids)
        self.finish_reasons: dict[int, Any] = {}  # choice index -> the finish_reason to send instead
        self.bare: set[int] = set()  # choice indices answered without logprobs


class Handler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        if self.server.fail_next:
            self.server.fail_next -= 1
            return self._send(503, {"error": "warming up"})
        if self.path != "/v1/completions" or body.get("model") != "tiny":
            return self._send(404, {"error": f"no model {body.get('model')!r} at {self.path}"})
        choices = []
        for p_idx, prompt in enumerate(body["prompt"]):
            a, b = prompt.rstrip("=").split("+")
            text = str(int(a) + int(b)).zfill(2)
            ids = [*TOK.encode(text), TOK.eos_id][: body["max_tokens"]]
            for k in range(body["n"]):
                tokens = (
                    [f"token_id:{i}" for i in ids]
                    if self.server.style == "token_ids"
                    else [TOK.token_text(i) for i in ids]
                )
                choices.append(
                    {
                        "index": p_idx * body["n"] + k,
                        "text": TOK.decode(ids),
                        "logprobs": {"tokens": tokens, "token_logprobs": [-0.25 * (k + 1)] * len(ids)},
                        "finish_reason": "stop" if ids[-1] == TOK.eos_id else "length",
                    }
                )
                index = p_idx * body["n"] + k
                if index in self.server.finish_reasons:
                    choices[-1]["finish_reason"] = self.server.finish_reasons[index]
                if index in self.server.bare:
                    choices[-1]["logprobs"] = None
        choices.reverse()  # servers may answer out of order; the client must sort by index
        self._send(200, {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": choices})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(server: FakeServer, **kw: Any) -> OpenAICompletionsClient:
    host, port = server.server_address[:2]
    return OpenAICompletionsClient(f"http://{host}:{port}", "tiny", tokenizer=TOK, api_key="k", **kw)


def test_completions_with_token_ids_and_logprobs(server: FakeServer) -> None:
    client = _client(server)
    assert isinstance(client, InferenceContext)
    out = client.complete(["3+4=", "9+9="], 2, SamplingParams(max_tokens=3, temperature=0.7), np.random.default_rng(0))
    assert [len(x) for x in out] == [2, 2]
    c = out[1][1]
    assert c.text == "18" and c.tokens == (*TOK.encode("18"), TOK.eos_id) and c.finish_reason == "stop"
    assert c.logprobs == (-0.5, -0.5, -0.5) and c.prompt_tokens == tuple(TOK.encode("9+9=", bos=True))
    req = server.requests[-1]
    assert req["auth"] == "Bearer k" and req["logprobs"] == 1 and req["n"] == 2 and req["temperature"] == 0.7
    assert req["prompt"] == ["3+4=", "9+9="] and req["return_tokens_as_token_ids"] is True


def test_token_strings_are_mapped_through_the_tokenizer(server: FakeServer) -> None:
    server.style = "strings"
    out = _client(server).complete(["1+2="], 1, SamplingParams(max_tokens=2), np.random.default_rng(0))
    assert out[0][0].tokens == tuple(TOK.encode("03")) and out[0][0].finish_reason == "length"


def test_transient_failures_are_retried_then_reported(server: FakeServer) -> None:
    server.fail_next = 1
    out = _client(server, max_retries=1).complete(["1+1="], 1, SamplingParams(3), np.random.default_rng(0))
    assert out[0][0].text == "02"
    server.fail_next = 5
    with pytest.raises(InferenceError, match="HTTP 503"):
        _client(server, max_retries=1).complete(["1+1="], 1, SamplingParams(3), np.random.default_rng(0))


def test_client_errors_are_not_retried(server: FakeServer) -> None:
    host, port = server.server_address[:2]
    client = OpenAICompletionsClient(f"http://{host}:{port}", "other", tokenizer=TOK, max_retries=3)
    with pytest.raises(InferenceError, match="HTTP 404"):
        client.complete(["1+1="], 1, SamplingParams(3), np.random.default_rng(0))
    assert len(server.requests) == 1


def test_an_environment_runs_against_the_server(server: FakeServer) -> None:
    env = ArithmeticEnv(holdout_fraction=0.0)
    groups, metrics = env.sample(_client(server), 5, 3, "train", np.random.default_rng(1))
    assert metrics["accuracy"] == 1.0 and all(g.size == 3 for g in groups)
    assert group_to_item(groups[0])["inference_logprobs"][2][-1] == -0.75


@pytest.mark.parametrize(
    ("sent", "kept"),
    [("stop", "stop"), ("length", "length"), ("abort", "abort"), ("error", "abort"), (None, "abort"), ("x", "abort")],
)
def test_finish_reasons_other_than_stop_and_length_are_aborts(server: FakeServer, sent: Any, kept: str) -> None:
    server.finish_reasons = {1: sent}
    out = _client(server).complete(["3+4="], 2, SamplingParams(max_tokens=3), np.random.default_rng(0))
    assert [c.finish_reason for c in out[0]] == ["stop", kept]


def test_an_aborted_choice_may_come_without_logprobs(server: FakeServer) -> None:
    server.finish_reasons, server.bare = {0: "abort"}, {0}
    out = _client(server).complete(["3+4="], 2, SamplingParams(max_tokens=3), np.random.default_rng(0))
    aborted, fine = out[0]
    assert aborted.finish_reason == "abort" and aborted.tokens == aborted.logprobs == () and aborted.text == "07"
    assert fine.finish_reason == "stop" and fine.tokens == (*TOK.encode("07"), TOK.eos_id)
    server.finish_reasons = {}  # a choice that will be trained on still needs them
    with pytest.raises(InferenceError, match="no logprobs"):
        _client(server).complete(["3+4="], 2, SamplingParams(max_tokens=3), np.random.default_rng(0))


def test_an_environment_leaves_out_a_prompt_the_server_aborted(server: FakeServer) -> None:
    server.finish_reasons = {4: "abort"}  # the second sample of the third prompt
    env = ArithmeticEnv(holdout_fraction=0.0)
    groups, _ = env.sample(_client(server), 4, 2, "train", np.random.default_rng(1))
    asked = [r["prompt"] for r in server.requests][-1]
    assert [group_info(g)["example_id"] for g in groups] == [asked[i].rstrip("=") for i in (0, 1, 3)]
