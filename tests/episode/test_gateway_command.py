"""``rollhub gateway``: the gateway assembled in front of engines and a buffer server, as the command builds it.

An OpenAI-client agent runs two sessions of one group through the gateway; the group reaches a real buffer server,
and the trainer's batch holds exactly the tokens the engine sampled, stamped with the version the trainer
published. The sink waits out a full buffer, the version follower never goes back, and every bad option exits 2
naming the flag."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from episode_fakes import FakeEngine, ScriptedPolicy, assert_exact_rows, group_rows, serve_in_thread, solver

from rollhub.client import TrainerClient
from rollhub.envs.episode.calculator import CalculatorEnv, calc
from rollhub.errors import QueueFull
from rollhub.gateway.app import create_gateway_app
from rollhub.run import gateway as command
from rollhub.server import ServerSettings, create_app

TOOLS = CalculatorEnv().tool_schemas()


def _agent(base_url: str, question: str) -> str:
    """Agent code as written for OpenAI: only its base_url points at the gateway."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(4):
        message = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calc(**json.loads(call.function.arguments))}
            )
    return ""


def _args(engine: str, buffer: str, tokenizer: Path, *extra: str) -> Any:
    argv = [
        "--engine",
        engine,
        "--model",
        "tiny",
        "--tokenizer",
        str(tokenizer),
        "--buffer",
        buffer,
        "--group-size",
        "2",
        "--max-tokens",
        "300",
        "--turn-max-tokens",
        "100",
        "--register-timeout",
        "60",
        *extra,
    ]
    return command.parser().parse_args(argv)


def test_an_openai_agent_trains_through_the_command_s_gateway(tiny_tokenizer: Any, tmp_path: Path) -> None:
    pytest.importorskip("openai")
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    buffer_app = create_app(ServerSettings(storage="memory"))
    with FakeEngine(ScriptedPolicy(tiny_tokenizer, solver)) as engine, serve_in_thread(buffer_app) as buffer:
        trainer = TrainerClient(buffer)
        trainer.register(batch_size=2, max_token_len=300, num_steps=10)
        assert trainer.get_batch() is None  # a trainer has started once it asked for a batch (the wait rule)
        trainer.publish_version(3)
        gateway, writer, follower, engines = command.build(_args(engine.url, buffer, tmp_path / "tok"))
        assert follower is not None
        follower.poll()  # the follower's thread polls the same way every --version-poll seconds
        assert gateway.policy_version == 3
        try:
            with serve_in_thread(create_gateway_app(gateway)) as url:
                opened = [httpx.post(f"{url}/sessions", json={"group": "g", "group_size": 2}).json() for _ in "ab"]
                answers = [_agent(o["base_url"], q) for o, q in zip(opened, ["6*7=?", "8*9=?"], strict=True)]
                assert answers == ["42", "72"]
                for o, reward in zip(opened, [1.0, 0.0], strict=True):
                    assert httpx.post(f"{url}/sessions/{o['session_id']}/finish", json={"reward": reward}).is_success
                batch = trainer.get_batch(wait_s=60)
        finally:
            writer.close()
            for e in engines:
                e.close()
    assert batch is not None and len(batch) == 1
    (group,) = batch
    assert assert_exact_rows(group_rows(group), engine.policy.handed_out) == 4  # two turns of each episode
    assert list(group.scores) == [1.0, 0.0]
    assert group.policy_version == 3


class _Writer:
    """A writer whose buffer is full for the first ``full`` calls, taking one group before each refusal."""

    def __init__(self, full: int) -> None:
        self.full, self.calls, self.stored = full, 0, []

    def write(self, groups: list[Any]) -> None:
        self.calls += 1
        if self.calls <= self.full:
            self.stored.append(groups[0])
            exc = QueueFull("full", retry_after_s=0.5)
            exc.accepted = 1  # type: ignore[attr-defined]
            raise exc
        self.stored.extend(groups)


def test_the_sink_waits_out_a_full_buffer_and_sends_each_group_once() -> None:
    now = [0.0]
    writer = _Writer(full=2)
    sink = command.BufferSink(
        writer, timeout_s=10, sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0]
    )
    sink(["a", "b", "c", "d"])
    assert writer.stored == ["a", "b", "c", "d"] and now[0] == pytest.approx(1.0)
    writer = _Writer(full=1)
    command.BufferSink(writer, timeout_s=0)(["a"])  # the refused call took the last group: nothing is resent
    assert writer.stored == ["a"] and writer.calls == 1


def test_the_sink_gives_up_after_its_timeout_and_says_how_many_were_not_sent() -> None:
    now = [0.0]
    sink = command.BufferSink(
        _Writer(full=100), timeout_s=2, sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0]
    )
    with pytest.raises(QueueFull, match=r"--send-timeout.*; 5 group"):
        sink(list("abcdefghij"))  # taken one by one at 0, 0.5, 1, 1.5 and 2 s


def test_the_version_follower_only_moves_forward_and_stops() -> None:
    class _Gateway:
        policy_version: int | None = None

    versions = iter([None, 2, 1, 5])
    seen = threading.Event()

    def read() -> int | None:
        try:
            return next(versions)
        except StopIteration:
            seen.set()
            return None

    gateway = _Gateway()
    follower = command.VersionFollower(gateway, read, every_s=0.001)
    follower.start()
    assert seen.wait(60)
    follower.stop()
    assert gateway.policy_version == 5


BAD = {  # one option made wrong (later options win) -> what the error must say
    "temperature": (["--temperature", "0"], "--temperature must be above 0"),
    "top-p": (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    "port": (["--port", "0"], "--port must be a port"),
    "group-size": (["--group-size", "0"], "--group-size must be at least 1"),
    "version-poll": (["--version-poll", "-1"], "--version-poll must be 0 (off) or more"),
    "discount": (["--discount", "0"], "--discount must be in (0, 1]"),
    "no scheme": (["--engine", "127.0.0.1:8001"], "give --engine and --buffer as http://HOST:PORT"),
    "no tokenizer": (["--tokenizer", "/nonexistent/tok"], "/nonexistent/tok"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_option_exits_2_saying_what_to_fix(case: str, capsys: Any) -> None:
    extra, said = BAD[case]
    argv = ["--model", "tiny", "--tokenizer", "/", "--buffer", "http://127.0.0.1:2"]
    engine = [] if "--engine" in extra else ["--engine", "http://127.0.0.1:1"]
    assert command.main([*engine, *argv, *extra]) == 2
    assert said in capsys.readouterr().err
