"""The engine supervisor with stand-in engine processes: a dead engine of the run is restarted and reloaded with the
newest version while pushes skip it, the bound on restarts ends supervision with a clear error, an engine at a
URL is never restarted, and a client waits out an engine that does not answer."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollhub.inference.engine import EngineDied, EngineError, EngineSpec, VLLMEngine
from rollhub.inference.openai_client import InferenceError, OpenAICompletionsClient
from rollhub.run.supervisor import EngineSupervisor
from rollhub.weights.engine import EngineVersionSubscriber

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


class StandIn(VLLMEngine):
    """A :class:`VLLMEngine` whose process is a sleeping Python (no vLLM); ``restart`` starts another one, and
    waits on ``gate`` first when one is given."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(EngineSpec(model="m"), subprocess.Popen(SLEEPER, start_new_session=True), 1, tmp_path / "log")
        self.gate: threading.Event | None = None
        self.restarted = 0

    def restart(self, stop: Any = None) -> None:
        if self.gate is not None:
            assert self.gate.wait(60)
        self.process = subprocess.Popen(SLEEPER, start_new_session=True)
        self.restarted += 1

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(60)


class Publisher:
    """Records pushes (with the engines skipped) and reloads."""

    def __init__(self) -> None:
        self.pushed: list[tuple[int, set[int]]] = []
        self.reloaded: list[int] = []
        self.failing: set[int] = set()  # engines whose push fails (their connection breaks)

    def publish(self, version: int, weights: Any, skip: Any = (), lost: Any = None) -> None:
        for index in sorted(self.failing - set(skip)):
            if lost is None or not lost(index):
                raise EngineError(f"POST http://engine{index}/pause failed (ReadError); is it up?")
        self.pushed.append((version, set(skip)))

    def reload(self, index: int) -> int | None:
        self.reloaded.append(index)
        return self.pushed[-1][0] if self.pushed else None


@pytest.fixture
def engines(tmp_path: Path) -> Any:
    made = [StandIn(tmp_path), StandIn(tmp_path)]
    yield made
    for engine in made:
        engine.stop(1)


def test_a_dead_engine_is_restarted_and_reloaded_while_pushes_skip_it(engines: list[StandIn]) -> None:
    publisher = Publisher()
    supervisor = EngineSupervisor(engines, publisher, max_restarts=2)
    supervisor.publish(1, {})
    engines[1].gate = threading.Event()
    engines[1].kill()
    looking = threading.Thread(target=supervisor.look)
    looking.start()
    while 1 not in supervisor.down:  # the supervisor marks it down before it restarts it
        threading.Event().wait(0.01)
    supervisor.publish(2, {})  # during the restart
    supervisor.check()  # a restart under way is not an error
    engines[1].gate.set()
    looking.join()
    assert publisher.pushed == [(1, set()), (2, {1})] and publisher.reloaded == [1]
    assert supervisor.restarts == [0, 1] and supervisor.down == set() and engines[1].restarted == 1
    assert "engine 1 died" in supervisor.events[0] and "back at" in supervisor.events[1]
    supervisor.look()  # alive again: nothing to do
    assert engines[1].restarted == 1


def test_an_engine_that_dies_during_a_push_is_skipped_and_restarted_with_that_version(engines: list[StandIn]) -> None:
    publisher = Publisher()
    supervisor = EngineSupervisor(engines, publisher, max_restarts=2)
    engines[0].kill()
    publisher.failing = {0}  # its connection broke in the middle of the push
    supervisor.publish(4, {})  # not an error: the engine is gone and will come back with version 4
    assert supervisor.down == {0} and publisher.pushed == [(4, set())]
    publisher.failing = set()
    supervisor.look()
    assert engines[0].restarted == 1 and publisher.reloaded == [0] and supervisor.down == set()
    assert supervisor.events[-1].endswith("with version 4")


def test_a_push_that_fails_on_a_live_engine_is_an_error(engines: list[StandIn]) -> None:
    publisher = Publisher()
    publisher.failing = {1}
    supervisor = EngineSupervisor(engines, publisher, max_restarts=2)
    with pytest.raises(EngineError, match="engine1/pause failed"):
        supervisor.publish(1, {})
    assert supervisor.down == set()


def test_past_max_restarts_check_raises_with_the_bound(engines: list[StandIn]) -> None:
    supervisor = EngineSupervisor(engines, Publisher(), max_restarts=1)
    engines[0].kill()
    supervisor.look()
    engines[0].kill()
    supervisor.look()
    with pytest.raises(EngineDied, match=r"restarted 1 time.*inference\.max_restarts"):
        supervisor.check()
    assert engines[0].restarted == 1


def test_without_restarts_a_death_ends_the_run_as_before(engines: list[StandIn]) -> None:
    supervisor = EngineSupervisor(engines, Publisher(), max_restarts=0)
    assert not supervisor.watching
    engines[0].kill()
    supervisor.look()
    assert engines[0].restarted == 0
    with pytest.raises(EngineDied, match="exited with code"):
        supervisor.check()


def test_an_engine_at_a_url_is_checked_and_never_restarted() -> None:
    class Remote:
        checked = 0

        def check(self) -> None:
            self.checked += 1
            raise EngineDied("vLLM server at http://x does not answer /health")

    remote = Remote()
    supervisor = EngineSupervisor([remote], Publisher(), max_restarts=3)
    assert not supervisor.watching
    supervisor.look()
    with pytest.raises(EngineDied, match="does not answer"):
        supervisor.check()
    assert remote.checked == 1


def test_clients_wait_out_an_engine_that_does_not_answer() -> None:
    calls = {"completions": 0, "weight_info": 0}

    def engine(request: httpx.Request) -> httpx.Response:
        name = request.url.path.rsplit("/", 1)[-1]
        calls[name] += 1
        if calls[name] <= 3:  # down for the first three calls
            raise httpx.ConnectError("connection refused", request=request)
        if name == "weight_info":
            return httpx.Response(200, json={"weight_version": "7"})
        choice = {"index": 0, "text": "1", "finish_reason": "stop", "token_ids": [5], "prompt_token_ids": [1],
                  "logprobs": {"token_logprobs": [-0.5]}}  # fmt: skip
        return httpx.Response(200, json={"choices": [choice]})

    transport = httpx.MockTransport(engine)
    client = OpenAICompletionsClient("http://e", "m", send_seed=False, max_retries=0, retry_for_s=120,
                                     transport=transport)  # fmt: skip
    from rollhub.inference.base import SamplingParams

    ((c,),) = client.complete([[1]], 1, SamplingParams(max_tokens=2), None)  # type: ignore[arg-type]
    assert c.tokens == (5,) and calls["completions"] == 4
    impatient = OpenAICompletionsClient("http://e", "m", send_seed=False, max_retries=0, transport=transport)
    calls["completions"] = 0
    with pytest.raises(InferenceError, match="does not answer"):
        impatient.complete([[1]], 1, SamplingParams(max_tokens=2), None)  # type: ignore[arg-type]
    subscriber = EngineVersionSubscriber("http://e", transport=transport, retry_for_s=120)
    for _ in range(3):
        subscriber.poll()  # keeps the last version (none yet) while the engine is away
        assert subscriber.loaded_version is None
    subscriber.poll()
    assert subscriber.loaded_version == 7
    calls["weight_info"] = 0
    with pytest.raises(Exception, match="weight_info failed"):
        EngineVersionSubscriber("http://e", transport=transport).poll()
