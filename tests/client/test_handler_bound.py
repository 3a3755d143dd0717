"""Several rollout handlers sharing one queue keep it near their threshold: each overshoots by at most one group,
whether nothing is consumed or a trainer drains the queue while they produce as fast as they can."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from rollhub.client import AsyncRolloutHandler, HandlerState, RolloutHandler, TrainerClient
from rollhub.client._core import TransitionNotes
from rollhub.experience import Group
from tests.client.conftest import CountingHandler, Running, start_trainer, toy_group, wait_until
from tests.conftest import ServerProcess

BATCH_SIZE = 8
TOLERANCE = 3
THRESHOLD = TOLERANCE * BATCH_SIZE  # 24 queued sequences, as in the report that two handlers swung to 2,152
GROUP_SIZE = 2
DEADLINE_S = 120.0


class QueueWatch:
    """The largest number of queued sequences seen by reading ``/status`` right after every accepted send."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=30)
        self.lock = threading.Lock()
        self.max_seen = 0

    def queued(self) -> int:
        status = self.client.get("/status").json()
        return int(status["queue_size"]) * GROUP_SIZE  # every group here has GROUP_SIZE sequences

    def sample(self) -> None:
        queued = self.queued()
        with self.lock:
            self.max_seen = max(self.max_seen, queued)


class Flooding(CountingHandler):
    """Produces toy groups as fast as it can and samples the queue after each accepted send."""

    def __init__(self, url: str, watch: QueueWatch, **settings: Any) -> None:
        super().__init__(url, group_size=GROUP_SIZE, off_policy_tolerance=TOLERANCE, **settings)
        self.watch = watch

    def on_accepted(self, groups: list[Group]) -> None:
        self.watch.sample()


class AsyncFlooding(AsyncRolloutHandler):
    """The asyncio form of :class:`Flooding`."""

    def __init__(self, url: str, watch: QueueWatch, **settings: Any) -> None:
        super().__init__(
            url,
            group_size=GROUP_SIZE,
            max_token_length=64,
            off_policy_tolerance=TOLERANCE,
            status_interval_s=0.05,
            **settings,
        )
        self.watch = watch
        self.made = 0

    async def collect(self) -> dict[str, Any]:
        await asyncio.sleep(0)
        self.made += 1
        return toy_group(self.made, GROUP_SIZE)

    def on_accepted(self, groups: list[Group]) -> None:
        self.watch.sample()


def _all_paused_over_threshold(handlers: list[Any], watch: QueueWatch) -> bool:
    """Stable when nothing consumes: every handler paused on a read showing the queue over the threshold."""
    return all(h.state is HandlerState.PAUSED for h in handlers) and watch.queued() > THRESHOLD


def _consume_until_all_resumed(trainer: TrainerClient, handlers: list[Any], watch: QueueWatch) -> None:
    """Take batches (sampling the queue after each) until every handler has resumed."""
    deadline = time.monotonic() + DEADLINE_S
    while not all(h.stats.resumes >= 1 for h in handlers):
        assert time.monotonic() < deadline, f"not every handler resumed within {DEADLINE_S} s of consuming"
        trainer.get_batch(wait_s=0.5)
        watch.sample()


def _check_bounded(handlers: list[Any], watch: QueueWatch, trainer: TrainerClient) -> None:
    bound = THRESHOLD + len(handlers) * GROUP_SIZE
    wait_until(lambda: _all_paused_over_threshold(handlers, watch), "every handler to pause", DEADLINE_S)
    final = watch.queued()
    assert THRESHOLD < final <= bound, f"{final} queued sequences with {len(handlers)} handlers, bound {bound}"
    assert watch.max_seen <= bound, f"the queue reached {watch.max_seen} sequences, bound {bound}"

    # A trainer consumes: every handler resumes, and the queue stays bounded meanwhile and once it stops.
    _consume_until_all_resumed(trainer, handlers, watch)
    wait_until(lambda: _all_paused_over_threshold(handlers, watch), "every handler to pause again", DEADLINE_S)
    final = watch.queued()
    assert THRESHOLD < final <= bound, f"{final} queued sequences after consuming, bound {bound}"
    assert watch.max_seen <= bound, f"the queue reached {watch.max_seen} sequences, bound {bound}"


@pytest.mark.parametrize("n_handlers", [2, 3])
def test_handlers_sharing_a_queue_overshoot_the_threshold_by_at_most_one_group_each(
    rollhub_server: ServerProcess, running: Callable[..., Running], n_handlers: int
) -> None:
    trainer = start_trainer(rollhub_server.url, batch_size=BATCH_SIZE)
    watch = QueueWatch(rollhub_server.url)
    # The default status interval (1 s): reads after every send, not the clock, must hold the queue.
    handlers: list[RolloutHandler] = [
        Flooding(rollhub_server.url, watch, name=f"flood{i}", status_interval_s=1.0) for i in range(n_handlers)
    ]
    runs = [running(h) for h in handlers]
    _check_bounded(handlers, watch, trainer)
    for r in runs:
        stats = r.stop()
        assert stats.pauses >= 2 and stats.resumes >= 1
        assert stats.status_checks >= stats.groups_sent, "every send follows a status read"
    watch.client.close()
    trainer.close()


def test_async_handlers_sharing_a_queue_overshoot_by_at_most_one_group_each(rollhub_server: ServerProcess) -> None:
    trainer = start_trainer(rollhub_server.url, batch_size=BATCH_SIZE)
    watch = QueueWatch(rollhub_server.url)
    handlers = [AsyncFlooding(rollhub_server.url, watch, name=f"aflood{i}") for i in range(2)]
    loop = asyncio.new_event_loop()
    tasks: list[asyncio.Task[Any]] = []

    async def run_all() -> None:
        tasks.extend(asyncio.create_task(h.run()) for h in handlers)
        await asyncio.gather(*tasks)

    thread = threading.Thread(target=loop.run_until_complete, args=(run_all(),), daemon=True)
    thread.start()
    try:
        _check_bounded(handlers, watch, trainer)
    finally:
        for h in handlers:
            h.stop()
        thread.join(60)
    assert not thread.is_alive(), "the async handlers did not stop"
    for task in tasks:
        assert task.result().pauses >= 2
    loop.close()
    watch.client.close()
    trainer.close()


def test_pause_and_resume_are_logged_at_info_at_most_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    notes = TransitionNotes("toy_0", every_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="rollhub.client"):
        assert notes.note("pause", 26, 24)
        for i in range(10):  # ten real changes a second for ten seconds: DEBUG only
            now[0] += 0.5
            assert not notes.note("resume" if i % 2 == 0 else "pause", 22, 24)
        now[0] = 61.0
        assert notes.note("resume", 20, 24)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert info == [
        "toy_0: 26 queued sequences > 24; pausing",
        "toy_0: 20 queued sequences <= 24; resuming (5 pauses and 5 resumes since the last note)",
    ]
    assert len(debug) == 10
