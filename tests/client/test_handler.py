"""The rollout handler's life over real loopback servers: pause and resume, stop and disconnect, server
restarts (sqlite and memory), backpressure (429), and errors that surface instead of dropping groups."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollhub.client import (
    AsyncRolloutHandler,
    DeliveryError,
    EnvClient,
    HandlerState,
    JsonlTracker,
    LifecycleError,
    NullTracker,
    RetryPolicy,
    TrainerClient,
)
from rollhub.errors import InvalidInput
from rollhub.experience import Group
from tests.client.conftest import CountingHandler, Running, drain, start_trainer, toy_group, wait_until
from tests.conftest import ServerProcess

QUICK = RetryPolicy(initial_backoff_s=0.02, max_backoff_s=0.25, give_up_after_s=60.0)


class AcceptedTags(CountingHandler):
    """Also records the tags of the groups the server accepted."""

    def __init__(self, url: str, **settings: Any) -> None:
        super().__init__(url, **settings)
        self.accepted: list[int] = []

    def on_accepted(self, groups: list[Group]) -> None:
        self.accepted.extend(int(g.tokens.row(0)[0]) for g in groups)


class CollectsOnceKilled(AcceptedTags):
    """After its first accepted group, its next ``collect`` sets ``waiting`` and returns only once ``killed`` is
    set, so the group it returns meets a dead server (the status read before it went to a live one)."""

    def __init__(self, url: str, killed: threading.Event, **settings: Any) -> None:
        super().__init__(url, **settings)
        self.killed = killed
        self.waiting = threading.Event()

    def collect(self) -> dict[str, Any]:
        if self.accepted:
            self.waiting.set()
            assert self.killed.wait(120), "the test never killed the server"
        return super().collect()


def served_tags(groups: list[Group]) -> set[int]:
    return {int(g.tokens.row(0)[0]) for g in groups}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pauses_when_the_trainer_stops_pulling_and_resumes_after_it_drains(
    any_server: Any, running: Callable[..., Running], tmp_path: Path
) -> None:
    trainer = start_trainer(any_server.url, batch_size=4, wandb_group="grp", wandb_project="proj")
    log = tmp_path / "handler.jsonl"
    handler = CountingHandler(any_server.url, off_policy_tolerance=1, tracker=JsonlTracker(log))
    run = running(handler)

    wait_until(lambda: handler.state is HandlerState.PAUSED, "the handler to pause")
    assert trainer.status().queue_size * handler.group_size > handler.threshold == 4
    collected, checks = len(handler.tags), handler.stats.status_checks
    wait_until(lambda: handler.stats.status_checks >= checks + 3, "three more status reads while paused")
    assert handler.state is HandlerState.PAUSED
    assert len(handler.tags) == collected, "a paused handler generates nothing"

    drained = drain(trainer)
    assert drained, "the trainer pulls what was queued"
    wait_until(lambda: handler.stats.resumes >= 1, "the handler to resume")
    wait_until(lambda: len(handler.tags) > collected, "the resumed handler to collect again")

    stats = run.stop()
    assert handler.state is HandlerState.STOPPED and stats.pauses >= 1
    lines = read_jsonl(log)
    assert lines[0]["event"] == "init"
    assert (lines[0]["name"], lines[0]["group"], lines[0]["project"]) == ("toy_0", "grp", "proj")
    events = [line.get("event") for line in lines]
    assert events.index("pause") < events.index("resume") < events.index("stop") < events.index("finish")
    assert any("queue/size" in line for line in lines) and any("env/reward" in line for line in lines)


def test_a_stopped_handler_appears_disconnected(any_server: Any, running: Callable[..., Running]) -> None:
    start_trainer(any_server.url)
    first = running(CountingHandler(any_server.url, name="first", off_policy_tolerance=1))
    second = running(CountingHandler(any_server.url, name="second", off_policy_tolerance=1))
    for r in (first, second):
        wait_until(lambda r=r: r.handler.stats.status_checks >= 1, f"{r.handler.name} to run")
    observer = EnvClient(any_server.url)
    assert observer.status_env(second.handler.env_id).env_weight == pytest.approx(0.5)

    first.stop()
    assert first.handler.state is HandlerState.STOPPED
    # Only connected envs share the weight: the stopped one no longer counts.
    assert observer.status_env(second.handler.env_id).env_weight == pytest.approx(1.0)
    assert second.handler.state is not HandlerState.STOPPED


def test_rides_through_a_server_kill_and_restart_on_sqlite_without_losing_an_accepted_group(
    server_factory: type[ServerProcess], tmp_path: Path, running: Callable[..., Running]
) -> None:
    db = f"sqlite:///{tmp_path / 'rollhub.db'}"
    server = server_factory("--storage", db).start()
    start_trainer(server.url, batch_size=2)  # one group per batch, so draining serves every group
    handler = AcceptedTags(server.url, off_policy_tolerance=50, retry=QUICK)
    run = running(handler)
    wait_until(lambda: len(handler.accepted) >= 10, "groups to be accepted before the crash")

    server.kill()
    at_kill = len(handler.accepted)
    wait_until(lambda: handler.stats.retries >= 2, "the handler to retry against the dead server")
    restarted = server_factory("--storage", db, port=server.port).start()
    wait_until(lambda: len(handler.accepted) >= at_kill + 10, "groups to be accepted after the restart")
    stats = run.stop()

    assert stats.registrations == 1, "the env survived the restart on sqlite; no new registration"
    served = served_tags(drain(TrainerClient(restarted.url)))
    lost = set(handler.accepted) - served
    assert not lost, f"accepted groups missing after the restart: {sorted(lost)[:10]}"


def test_registers_again_when_a_restarted_server_lost_its_data(
    server_factory: type[ServerProcess], running: Callable[..., Running]
) -> None:
    server = server_factory("--storage", "memory").start()
    start_trainer(server.url)
    handler = AcceptedTags(server.url, off_policy_tolerance=50, retry=QUICK)
    run = running(handler)
    wait_until(lambda: len(handler.accepted) >= 3, "groups to be accepted")
    server.kill()
    restarted = server_factory("--storage", "memory", port=server.port).start()
    at_restart = len(handler.accepted)
    trainer = start_trainer(restarted.url, batch_size=2)  # a new run: the handler registers once it pulls
    wait_until(lambda: handler.stats.registrations == 2, "the handler to register again")
    wait_until(lambda: len(handler.accepted) >= at_restart + 3, "groups to be accepted by the new server")
    run.stop()
    after = set(handler.accepted[at_restart:])
    assert after <= served_tags(drain(trainer)), "groups accepted after the restart are all served"


def test_429_slows_the_handler_down_instead_of_failing(
    server_factory: type[ServerProcess], running: Callable[..., Running]
) -> None:
    server = server_factory("--storage", "memory", "--max-queued-sequences", "8", "--retry-after", "1").start()
    trainer = start_trainer(server.url, batch_size=4)
    handler = AcceptedTags(server.url, off_policy_tolerance=100)
    run = running(handler, max_groups=10)
    wait_until(lambda: handler.stats.throttled >= 1, "the server to refuse with 429")
    assert handler.state is HandlerState.RUNNING
    served: set[int] = set()
    while run.thread.is_alive():
        batch = trainer.get_batch(wait_s=0.5)
        served |= served_tags(list(batch or []))
    stats = run.join()
    served |= served_tags(drain(trainer))
    assert stats.groups_sent == 10 and stats.throttled >= 1
    assert set(handler.accepted) == set(range(1, 11)) == served


def test_a_group_the_server_refuses_raises_with_its_message(
    rollhub_server: ServerProcess, running: Callable[..., Running]
) -> None:
    class TooBig(CountingHandler):
        def collect(self) -> dict[str, Any]:
            return toy_group(1, n=3)  # registered group_size is 2

    start_trainer(rollhub_server.url)
    handler = TooBig(rollhub_server.url)
    with pytest.raises(InvalidInput, match="group_size 2") as info:
        running(handler).join()
    assert "1 group(s) in hand were not delivered" in info.value.__notes__[0]
    assert handler.state is HandlerState.STOPPED


def test_groups_that_cannot_be_delivered_are_surfaced_with_the_reason(
    server_factory: type[ServerProcess], running: Callable[..., Running]
) -> None:
    server = server_factory("--storage", "memory").start()
    start_trainer(server.url)
    policy = RetryPolicy(initial_backoff_s=0.02, max_backoff_s=0.1, give_up_after_s=1.0)
    killed = threading.Event()
    handler = CollectsOnceKilled(server.url, killed, off_policy_tolerance=25, retry=policy)
    run = running(handler)
    wait_until(handler.waiting.is_set, "a group to be accepted and the next one collected")
    server.kill()
    killed.set()  # the group collected now meets a dead server
    with pytest.raises(DeliveryError, match="ConnectError") as info:
        run.join()
    assert len(info.value.groups) == 1
    undelivered = int(info.value.groups[0].tokens.row(0)[0])
    assert undelivered not in handler.accepted and undelivered in handler.tags
    assert handler.state is HandlerState.STOPPED


def test_handler_waits_for_the_trainer_and_stop_ends_the_wait(rollhub_server: ServerProcess) -> None:
    TrainerClient(rollhub_server.url).register(batch_size=4, max_token_len=64, num_steps=1)  # never pulls
    handler = CountingHandler(rollhub_server.url)
    run = Running(handler)
    wait_until(lambda: handler.state is HandlerState.STARTING, "the handler to start")
    handler.stop()
    stats = run.join()
    assert stats.registrations == 0 and handler.tags == [] and handler.state is HandlerState.STOPPED
    with pytest.raises(LifecycleError, match="runs once"):
        handler.run()


class BrokenTracker(NullTracker):
    def init(self, *, project: str | None, group: str | None, name: str, config: dict[str, Any]) -> None:
        raise RuntimeError("tracker backend is down")


def test_a_failure_after_registering_still_disconnects_the_env(rollhub_server: ServerProcess) -> None:
    start_trainer(rollhub_server.url)
    observer = EnvClient(rollhub_server.url)
    other = observer.register_env(desired_name="observer", group_size=2, max_token_length=64)
    assert other is not None
    handler = CountingHandler(rollhub_server.url, tracker=BrokenTracker())
    with pytest.raises(RuntimeError, match="tracker backend is down"):
        handler.run()
    assert handler.env_id is not None and handler.state is HandlerState.STOPPED
    assert observer.status_env(other.env_id).env_weight == pytest.approx(1.0), "the failed handler disconnected"


class AsyncCounting(AsyncRolloutHandler):
    def __init__(self, url: str, **settings: Any) -> None:
        super().__init__(url, name="async_toy", group_size=2, max_token_length=64, **settings)
        self.tags: list[int] = []

    async def collect(self) -> list[dict[str, Any]]:
        await asyncio.sleep(0)
        self.tags += [len(self.tags) + 1, len(self.tags) + 2]
        return [toy_group(self.tags[-2]), toy_group(self.tags[-1])]  # a list goes to /scored_data_list


def test_async_handler_sends_pauses_and_stops(any_server: Any, tmp_path: Path) -> None:
    trainer = start_trainer(any_server.url, batch_size=4)
    handler = AsyncCounting(
        any_server.url, status_interval_s=0.05, off_policy_tolerance=1, tracker=f"jsonl:{tmp_path / 'a.jsonl'}"
    )

    async def scenario() -> None:
        task = asyncio.create_task(handler.run())
        while handler.state is not HandlerState.PAUSED:
            assert not task.done(), task
            await asyncio.sleep(0.01)
        handler.stop()
        stats = await asyncio.wait_for(task, 30)
        assert stats.groups_sent == len(handler.tags) >= 4 and stats.pauses == 1

    asyncio.run(scenario())
    assert handler.state is HandlerState.STOPPED
    assert served_tags(drain(trainer)) == set(handler.tags)
    assert read_jsonl(tmp_path / "a.jsonl")[0]["name"] == "async_toy_0"
