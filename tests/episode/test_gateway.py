"""The capture gateway in process (FastAPI's TestClient, scripted engines): an OpenAI-shaped tool loop recorded with
exact tokens, history the agent rewrites, the 4xx answers, rewards posted or scored, and the partial-episode rule."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from episode_fakes import ScriptedPolicy, assert_exact_rows, solver
from fastapi.testclient import TestClient

from rollhub.envs.episode import ChatRenderer, Outcome
from rollhub.envs.episode.calculator import CalculatorEnv, calc
from rollhub.experience import Group
from rollhub.gateway import Gateway, GatewayConfig
from rollhub.gateway.app import create_gateway_app
from rollhub.inference.base import SamplingParams
from rollhub.wire.group import check_group

TOOLS = CalculatorEnv().tool_schemas()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup(tiny_tokenizer: Any) -> Iterator[tuple[TestClient, Gateway, list[Group], ScriptedPolicy, Clock]]:
    sent: list[Group] = []
    engine = ScriptedPolicy(tiny_tokenizer, solver)
    clock = Clock()
    config = GatewayConfig(model="tiny", max_tokens=300, turn_max_tokens=100, sampling=SamplingParams(temperature=0.7),
                           idle_timeout_s=60)  # fmt: skip
    gateway = Gateway([engine], ChatRenderer(tiny_tokenizer), config, sent.extend, clock=clock)
    with TestClient(create_gateway_app(gateway, reap_every_s=3600)) as client:
        yield client, gateway, sent, engine, clock


def run_agent(client: TestClient, base: str, question: str, **extra: Any) -> list[dict[str, Any]]:
    """A tool-using agent loop as OpenAI-client code writes it, over ``base`` (a session's ``base_url``)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for _ in range(4):
        answer = client.post(f"{base}/chat/completions", json={"model": "tiny", "messages": messages, "tools": TOOLS,
                                                               "temperature": 1.3, **extra})  # fmt: skip
        assert answer.status_code == 200, answer.text
        message = answer.json()["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        if not message.get("tool_calls"):
            return messages
        for call in message["tool_calls"]:
            result = calc(**json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return messages


def test_an_openai_tool_loop_becomes_an_episode_of_the_engines_ids(setup: Any, tiny_tokenizer: Any) -> None:
    client, gateway, sent, engine, _ = setup
    bases = []
    for _ in range(2):
        opened = client.post("/sessions", json={"group": "7*8", "group_size": 2, "metadata": {"answer": 56}}).json()
        bases.append(opened["base_url"].removeprefix("http://testserver"))
    for base in bases:
        messages = run_agent(client, base, "7*8=?")
        assert messages[1]["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"a": 7, "b": 8}'}
        assert messages[-1] == {"role": "assistant", "content": "56"}
        assert sent == []  # the group waits for both of its sessions
        client.post(f"{base.removesuffix('/v1')}/finish", json={"reward": 1.0, "correct": True})
    (group,) = sent
    check_group(group)
    assert group.size == 2 and list(group.scores) == [1.0, 1.0]
    assert assert_exact_rows(group, engine.handed_out) == 4  # two sampled turns per row, one row per session
    renderer = ChatRenderer(tiny_tokenizer)
    text = renderer.text(group.meta["messages"][0], TOOLS, False)
    assert list(group.tokens.row(0)) == renderer.encode(text, special=True)[:-1]  # the conversation, exactly
    assert group.meta["generation_params"]["temperature"] == 0.7  # the gateway's setting, not the agent's 1.3
    assert all(s.max_tokens <= 100 for s in engine.handed_out)
    assert gateway.status()["groups_sent"] == 1 and gateway.status()["forks"] == 0


def test_history_the_agent_rewrites_starts_a_new_row(setup: Any) -> None:
    client, gateway, sent, engine, _ = setup
    base = client.post("/sessions", json={}).json()["base_url"].removeprefix("http://testserver")
    messages = run_agent(client, base, "3*4=?")
    # the agent drops the tool exchange from its context and asks again: the row cannot be extended
    short = [messages[0], {"role": "user", "content": "6*7=?"}]
    assert client.post(f"{base}/chat/completions", json={"messages": short}).status_code == 200
    client.post(f"{base.removesuffix('/v1')}/finish", json={"reward": 0.5})
    (group,) = sent
    assert group.size == 2 and gateway.status()["forks"] == 1
    assert [o["rollhub"]["row"] for o in group.meta["overrides"]] == [0, 1]
    assert assert_exact_rows(group, engine.handed_out) == 3


def test_clear_4xx_answers(setup: Any) -> None:
    client, _, _, _, _ = setup
    assert client.post("/sessions/nope/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
                       ).json()["error"]["code"] == "session_not_found"  # fmt: skip
    base = client.post("/sessions", json={"max_tokens": 60}).json()["base_url"].removeprefix("http://testserver")
    ask = {"messages": [{"role": "user", "content": "2*3=?"}]}
    wrong = client.post(f"{base}/chat/completions", json={**ask, "model": "gpt-4o"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    for bad in ({"n": 2}, {"stream": True}, {"stop": ["\n"]}, {"messages": "hi"}):
        assert client.post(f"{base}/chat/completions", json={**ask, **bad}).status_code == 400, bad
    over = client.post(f"{base}/chat/completions", json={"messages": [{"role": "user", "content": "9" * 80}]})
    assert over.status_code == 400 and over.json()["error"]["code"] == "episode_budget_exceeded"
    cut = client.post(f"{base}/chat/completions", json=ask).json()  # a tool call does not fit in what is left
    assert cut["choices"][0]["finish_reason"] == "length"
    session = client.get(base.removesuffix("/v1")).json()
    assert session["truncated"] and session["tokens"] == 60
    assert client.post(f"{base.removesuffix('/v1')}/finish", json={"reward": 0.0}).status_code == 200
    closed = client.post(f"{base}/chat/completions", json=ask)
    assert closed.status_code == 409 and closed.json()["error"]["code"] == "session_closed"


def test_partial_episodes_are_kept_with_a_reward_and_dropped_without(setup: Any) -> None:
    client, gateway, sent, _, clock = setup
    bases = [client.post("/sessions", json={"group": "g", "group_size": 2}).json()["base_url"] for _ in range(2)]
    paths = [b.removeprefix("http://testserver") for b in bases]
    for path in paths:
        client.post(f"{path}/chat/completions", json={"messages": [{"role": "user", "content": "2*3=?"}]})
    client.post(f"{paths[0].removesuffix('/v1')}/reward", json={"reward": 0.25})
    clock.now = 61.0  # both agents went quiet past the idle timeout
    assert gateway.reap() == 2
    assert sent == [] and gateway.status()["groups_dropped"] == 1  # one had no reward: its group is dropped
    assert gateway.status()["kept"] == 1 and gateway.status()["dropped"] == 1

    bases = [client.post("/sessions", json={"group": "h", "group_size": 2}).json()["base_url"] for _ in range(2)]
    paths = [b.removeprefix("http://testserver") for b in bases]
    for path in paths:
        client.post(f"{path}/chat/completions", json={"messages": [{"role": "user", "content": "2*3=?"}]})
        client.post(f"{path.removesuffix('/v1')}/reward", json={"reward": 0.5})
    assert client.delete(paths[0].removesuffix("/v1")).json()["state"] == "abandoned"
    client.post(f"{paths[1].removesuffix('/v1')}/finish")  # the reward it posted earlier
    (group,) = sent
    records = [o["rollhub"] for o in group.meta["overrides"]]
    assert [r["finish"] for r in records] == ["abandoned", "done"]
    assert [r["truncated"] for r in records] == [True, False]
    assert np.array_equal(group.scores, [0.5, 0.5])


def test_a_scorer_judges_what_the_agent_does_not(tiny_tokenizer: Any) -> None:
    sent: list[Group] = []

    def scorer(task: Any, episode: Any) -> Outcome:
        final = episode.messages[-1]["content"]
        return Outcome(float(final == str(task.data["answer"])), final == str(task.data["answer"]))

    config = GatewayConfig(model="tiny", max_tokens=300, turn_max_tokens=100)
    gateway = Gateway([ScriptedPolicy(tiny_tokenizer, solver)], ChatRenderer(tiny_tokenizer), config, sent.extend,
                      scorer=scorer)  # fmt: skip
    with TestClient(create_gateway_app(gateway)) as client:
        base = client.post("/sessions", json={"metadata": {"answer": 12}}).json()["base_url"]
        path = base.removeprefix("http://testserver")
        run_agent(client, path, "3*4=?")
        assert client.post(f"{path.removesuffix('/v1')}/finish").json()["state"] == "finished"
    assert sent[0].scores[0] == 1.0 and sent[0].meta["group_overrides"]["rollhub"]["correct"] == [True]


def test_completions_calls_extend_the_row_when_their_ids_do(setup: Any) -> None:
    client, gateway, sent, engine, _ = setup
    base = client.post("/sessions", json={}).json()["base_url"].removeprefix("http://testserver")
    first = client.post(f"{base}/completions", json={"prompt": "user: 2*3=?\nassistant: "}).json()
    assert first["object"] == "text_completion" and first["choices"][0]["text"].startswith("<tool_call>")
    row = engine.handed_out[-1].prompt + engine.handed_out[-1].ids
    tail = engine.tokenizer("\ntool: <tool_response>6</tool_response>\nassistant: ", add_special_tokens=False)
    client.post(f"{base}/completions", json={"prompt": row + tail["input_ids"]})
    client.post(f"{base.removesuffix('/v1')}/finish", json={"reward": 1.0})
    (group,) = sent
    assert group.size == 1 and gateway.status()["forks"] == 0
    assert assert_exact_rows(group, engine.handed_out) == 2


def test_a_sink_that_fails_is_a_503_and_counted(tiny_tokenizer: Any) -> None:
    def broken(groups: list[Group]) -> None:
        raise OSError("disk full")

    config = GatewayConfig(model="tiny", max_tokens=300, turn_max_tokens=100)
    gateway = Gateway([ScriptedPolicy(tiny_tokenizer, solver)], ChatRenderer(tiny_tokenizer), config, broken)
    with TestClient(create_gateway_app(gateway)) as client:
        path = client.post("/sessions", json={}).json()["base_url"].removeprefix("http://testserver")
        run_agent(client, path, "3*4=?")
        answer = client.post(f"{path.removesuffix('/v1')}/finish", json={"reward": 1.0})
    assert answer.status_code == 503 and "disk full" in answer.json()["error"]["message"]
    assert gateway.status()["groups_failed"] == 1


def test_a_turn_keeps_the_version_the_engine_reports_for_each_token(setup: Any) -> None:
    client, _, sent, engine, _ = setup
    engine.version_of = lambda k, i: 5 + k + (i >= 2)  # a push after the second token of every turn
    client.post("/policy-version", json={"policy_version": 5})
    base = client.post("/sessions", json={}).json()["base_url"].removeprefix("http://testserver")
    run_agent(client, base, "3*4=?")
    client.post(f"{base.removesuffix('/v1')}/finish", json={"reward": 1.0})
    (group,) = sent
    versions, mask = np.asarray(group.token_versions.row(0)), np.asarray(group.masks.row(0))
    sampled = versions[mask != -100]
    first, second = (len(s.ids) for s in engine.handed_out)
    assert list(sampled) == [5 + (i >= 2) for i in range(first)] + [6 + (i >= 2) for i in range(second)]
    assert group.policy_version == 5 and np.all(versions[mask == -100] == -1)
