"""The gateway on a real socket (uvicorn on a free loopback port) in front of two fake OpenAI engines (real sockets,
vLLM's answer shape): two agents written against the ``openai`` client run at once, each pinned to its own engine,
and an agent that disconnects mid-call loses nothing."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from episode_fakes import FakeEngine, ScriptedPolicy, assert_exact_rows, serve_in_thread, solver

from rollhub.envs.episode import ChatRenderer
from rollhub.envs.episode.calculator import CalculatorEnv, calc
from rollhub.experience import Group
from rollhub.gateway import Gateway, GatewayConfig
from rollhub.gateway.app import create_gateway_app
from rollhub.inference.openai_client import OpenAICompletionsClient

TOOLS = CalculatorEnv().tool_schemas()


@pytest.fixture
def live(tiny_tokenizer: Any) -> Iterator[tuple[str, list[Group], list[FakeEngine]]]:
    sent: list[Group] = []
    with (
        FakeEngine(ScriptedPolicy(tiny_tokenizer, solver)) as a,
        FakeEngine(ScriptedPolicy(tiny_tokenizer, solver)) as b,
    ):
        clients = [OpenAICompletionsClient(e.url, "tiny", send_seed=False, max_retries=0) for e in (a, b)]
        config = GatewayConfig(model="tiny", max_tokens=300, turn_max_tokens=100)
        gateway = Gateway(clients, ChatRenderer(tiny_tokenizer), config, sent.extend)
        with serve_in_thread(create_gateway_app(gateway)) as url:
            yield url, sent, [a, b]
        for c in clients:
            c.close()


def openai_agent(base_url: str, question: str) -> str:
    """Agent code as written for OpenAI: only its base_url points at the gateway."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(4):
        reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0.9)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            result = calc(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def test_two_concurrent_agents_each_pinned_to_one_engine(live: Any) -> None:
    pytest.importorskip("openai")
    url, sent, engines = live
    opened = [httpx.post(f"{url}/sessions", json={"group": "pair", "group_size": 2}).json() for _ in range(2)]
    assert sorted(o["engine"] for o in opened) == [0, 1]  # the least busy engine each time
    answers: dict[int, str] = {}
    start = threading.Barrier(2)

    def run(i: int, question: str) -> None:
        start.wait()
        answers[i] = openai_agent(opened[i]["base_url"], question)

    threads = [threading.Thread(target=run, args=(i, q)) for i, q in enumerate(["6*7=?", "8*9=?"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == {0: "42", 1: "72"}
    for o, reward in zip(opened, [1.0, 0.0], strict=True):
        httpx.post(f"{url}/sessions/{o['session_id']}/finish", json={"reward": reward})
    (group,) = sent
    for o in opened:  # every call of a session went to its engine, and only there
        asked = "6*7" if o is opened[0] else "8*9"
        mine = engines[o["engine"]].policy.handed_out
        other = engines[1 - o["engine"]].policy.handed_out
        assert len(mine) == 2 and all(asked in engines[0].policy.tokenizer.decode(s.prompt) for s in mine)
        assert not any(asked in engines[0].policy.tokenizer.decode(s.prompt) for s in other)
    assert assert_exact_rows(group, [*engines[0].policy.handed_out, *engines[1].policy.handed_out]) == 4
    assert list(group.scores) == [1.0, 0.0]


def test_an_agent_that_disconnects_mid_call_loses_nothing(live: Any) -> None:
    url, sent, engines = live
    session = httpx.post(f"{url}/sessions", json={}).json()
    engine = engines[session["engine"]]
    engine.gate.clear()  # the engine holds the call until the agent is gone
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "2*3=?"}]}).encode()
    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port)) as sock:
        head = f"POST /sessions/{session['session_id']}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        assert engine.waiting.wait(30)
    engine.gate.set()  # the agent has disconnected; now the engine answers
    info = httpx.get(f"{url}/sessions/{session['session_id']}").json()
    for _ in range(3000):
        if info["turns"] == 1:
            break
        threading.Event().wait(0.01)
        info = httpx.get(f"{url}/sessions/{session['session_id']}").json()
    assert info["turns"] == 1 and info["sampled_tokens"] > 0
    # the agent never comes back; its runner posts the reward it judged and gives the session up
    httpx.post(f"{url}/sessions/{session['session_id']}/reward", json={"reward": 0.3})
    assert httpx.delete(f"{url}/sessions/{session['session_id']}").json()["state"] == "abandoned"
    (group,) = sent  # with a reward posted, the abandoned episode is kept, flagged truncated
    assert group.meta["overrides"][0]["rollhub"]["finish"] == "abandoned" and group.scores[0] == pytest.approx(0.3)
    assert assert_exact_rows(group, engine.policy.handed_out) == 1
