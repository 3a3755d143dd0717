"""RolloutWorker as a plain object around a fake manager: weights between batches, tags, backpressure."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from rollhub.errors import ConfigError
from rollhub.rollout.protocols import Backlog, SampleRequest, SampleResult
from rollhub.rollout.replay import PartialWrite
from rollhub.rollout.worker import RolloutWorker, RolloutWorkerConfig
from rollhub.weights import WeightUpdate
from rollhub.weights.base import OfferedWeightSubscriber


class FakeManager:
    """Produces one item per call: (policy_version, weights in use, min_version); records shutdown."""

    def __init__(self, worker_id: str) -> None:
        self.weights: Mapping[str, np.ndarray] = {}
        self.closed = False
        self.produced = 0

    def sample_batch(self, request: SampleRequest) -> SampleResult:
        time.sleep(0.001)
        item = (request.policy_version, float(self.weights["v"]), request.min_version, self.produced)
        self.produced += 1
        return SampleResult(items=[item], env_steps=1, timings={"inference": 0.001})

    def update_model(self, weights: Mapping[str, np.ndarray]) -> None:
        self.weights = weights

    def shutdown(self) -> None:
        self.closed = True


class FlakyWriter:
    """Refuses part of the first write (like a full replay buffer), then accepts everything."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.refusals = 0

    def write(self, items: list[Any]) -> None:
        if self.refusals < 3:  # the first writes are refused, the last of them only in part
            self.refusals += 1
            accepted = len(items) // 2 if self.refusals == 3 else 0
            self.items.extend(items[:accepted])
            raise PartialWrite("full", retry_after_s=0.01, accepted=accepted)
        self.items.extend(items)

    def close(self) -> None:
        pass


class CountingSubscriber(OfferedWeightSubscriber):
    """The worker's usual subscriber, setting ``polled`` once the worker's loop has asked it ``n`` times."""

    def __init__(self, n: int = 5) -> None:
        super().__init__()
        self.n, self.polls, self.polled = n, 0, threading.Event()

    def poll(self) -> WeightUpdate | None:
        self.polls += 1
        if self.polls >= self.n:
            self.polled.set()
        return super().poll()


def _wait(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_worker_tags_items_with_the_loaded_version_and_resends_only_refused_items() -> None:
    writer = FlakyWriter()
    subscriber = CountingSubscriber()
    config = RolloutWorkerConfig(max_staleness=2, queue_size=4)
    worker = RolloutWorker("w", FakeManager, writer, config, subscriber=subscriber)
    worker.start()
    try:
        assert subscriber.polled.wait(60), "the worker's loop asks for weights"
        assert worker.info()["state"] == "waiting_for_weights" and writer.items == []  # nothing before weights
        for version in range(5):
            worker.offer_weights(version, WeightUpdate(version, {"v": np.array(float(version))}))
            _wait(lambda v=version: any(item[0] == v for item in writer.items))
    finally:
        worker.stop()
    assert worker.manager.closed and worker.info()["state"] == "stopped"
    assert writer.refusals == 3
    assert [item[3] for item in writer.items] == list(range(len(writer.items))), "no loss, no duplicate"
    assert all(tag == used for tag, used, _, _ in writer.items), "tag == the weights actually in use"
    assert all(min_version == tag - 2 for tag, _, min_version, _ in writer.items)
    # at stop, only what the bounded queue and the write in progress held is dropped
    assert worker.manager.produced - len(writer.items) <= 2 * 4 + 1
    assert worker.items_sent == len(writer.items)


class BrokenManager(FakeManager):
    def sample_batch(self, request: SampleRequest) -> SampleResult:
        raise RuntimeError("simulator lost")


def test_a_failing_manager_marks_the_worker_failed_with_the_reason() -> None:
    worker = RolloutWorker("w", BrokenManager, FlakyWriter())
    worker.offer_weights(0, WeightUpdate(0, {"v": np.array(0.0)}))
    worker.start()
    _wait(lambda: worker.info()["state"] == "failed")
    worker.stop()
    info = worker.info()
    assert info["state"] == "failed" and "simulator lost" in info["error"]


class ListWriter:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def write(self, items: list[Any]) -> None:
        self.items.extend(items)

    def close(self) -> None:
        pass


def test_a_paced_worker_makes_its_quota_per_version_then_waits_for_the_next() -> None:
    writer = ListWriter()
    config = RolloutWorkerConfig(max_staleness=2, items_per_version=5, pace_timeout_s=3600.0)
    worker = RolloutWorker("w", FakeManager, writer, config)
    worker.start()
    try:
        for version in range(3):
            waits = worker.pace_waits
            worker.offer_weights(version, WeightUpdate(version, {"v": np.array(float(version))}))
            _wait(lambda w=waits: worker.pace_waits > w + 10, timeout=60)  # quota made, now waiting
            _wait(lambda v=version: sum(item[0] == v for item in writer.items) >= 5, timeout=60)
        made = worker.manager.produced
    finally:
        worker.stop()
    assert [sum(item[0] == v for item in writer.items) for v in range(3)] == [5, 5, 5]
    assert made == 15, "nothing beyond the quota while the trainer has not moved on"


def test_a_paced_worker_makes_another_round_when_no_new_version_comes() -> None:
    writer = ListWriter()
    config = RolloutWorkerConfig(items_per_version=3, pace_timeout_s=0.05)
    worker = RolloutWorker("w", FakeManager, writer, config)
    worker.offer_weights(0, WeightUpdate(0, {"v": np.array(0.0)}))
    worker.start()
    try:
        _wait(lambda: len(writer.items) >= 9, timeout=60)
    finally:
        worker.stop()
    assert len(writer.items) >= 9 and worker.pace_waits > 0


class GatedManager(FakeManager):
    """One item per turn the test allows (``gate.release()``); an empty turn otherwise."""

    gate = threading.Semaphore(0)

    def sample_batch(self, request: SampleRequest) -> SampleResult:
        if not self.gate.acquire(timeout=0.02):
            return SampleResult()
        self.produced += 1
        return SampleResult(items=[self.produced], env_steps=1)


class CallWriter(ListWriter):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def write(self, items: list[Any]) -> None:
        self.calls.append(len(items))
        super().write(items)


def _gated_worker(config: RolloutWorkerConfig) -> tuple[RolloutWorker, CallWriter]:
    GatedManager.gate = threading.Semaphore(0)
    writer = CallWriter()
    worker = RolloutWorker("w", GatedManager, writer, config)
    worker.offer_weights(0, WeightUpdate(0, {"v": np.array(0.0)}))
    worker.start()
    return worker, writer


def test_items_made_soon_after_a_write_wait_for_the_interval_and_leave_together() -> None:
    worker, writer = _gated_worker(RolloutWorkerConfig(write_interval_s=3600.0))
    try:
        GatedManager.gate.release()
        _wait(lambda: writer.calls == [1])  # after a quiet spell: at once
        GatedManager.gate.release(9)
        _wait(lambda: worker.info()["queued"] == 8)  # the sender holds item 2, the queue the other 8
        time.sleep(0.2)
        assert writer.calls == [1], "held until the interval has passed"
    finally:
        worker.stop()  # stopping flushes them
    assert writer.calls == [1, 9] and writer.items == list(range(1, 11)) and worker.info()["writes"] == 2


def test_a_half_full_queue_is_written_at_once() -> None:
    worker, writer = _gated_worker(RolloutWorkerConfig(write_interval_s=3600.0, queue_size=8))
    try:
        GatedManager.gate.release(40)
        _wait(lambda: len(writer.items) == 40, timeout=60)
    finally:
        worker.stop()
    assert writer.items == list(range(1, 41)) and len(writer.calls) < 40


def test_a_paced_worker_writes_its_quota_before_it_waits_for_the_next_version() -> None:
    config = RolloutWorkerConfig(write_interval_s=3600.0, items_per_version=5, pace_timeout_s=3600.0)
    worker, writer = _gated_worker(config)
    try:
        GatedManager.gate.release()
        _wait(lambda: writer.calls == [1])
        GatedManager.gate.release(19)  # 4 more make the quota, then the worker waits for version 1
        _wait(lambda: len(writer.items) == 5, timeout=60)
        assert writer.items == [1, 2, 3, 4, 5]
    finally:
        worker.stop()


def test_a_negative_write_interval_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="write_interval_s"):
        RolloutWorkerConfig(write_interval_s=-0.1)


class QueueWriter(ListWriter):
    """A server queue in miniature: what was written waits until the test serves it (``serve(n)``); the trainer's
    published version is ``version``."""

    def __init__(self, version: int | None = None, next_version: int | None = None) -> None:
        super().__init__()
        self.served = 0
        self.largest = 0  # the longest the queue ever was
        self.version = version
        self.next_version = next_version  # the version the next batch is trained at (None: not reported)

    def write(self, items: list[Any]) -> None:
        super().write(items)
        self.largest = max(self.largest, self.queued())

    def queued(self) -> int:
        return len(self.items) - self.served

    def backlog(self) -> Backlog:
        return Backlog(self.queued(), self.version, self.next_version)

    def serve(self, n: int) -> None:
        self.served = min(len(self.items), self.served + n)


def _running(writer: Any, config: RolloutWorkerConfig) -> RolloutWorker:
    """A started worker around :class:`FakeManager` with version 0 offered."""
    worker = RolloutWorker("w", FakeManager, writer, config)
    worker.offer_weights(0, WeightUpdate(0, {"v": np.array(0.0)}))
    worker.start()
    return worker


def _held(worker: RolloutWorker) -> int:
    """What the worker has made once admission holds it back (checked to stay put while it waits)."""
    _wait(lambda: worker.admission_waits > 0, timeout=60)
    time.sleep(0.2)  # a held worker makes nothing more, however long it waits
    made = worker.manager.produced
    time.sleep(0.2)
    assert worker.manager.produced == made
    return made


def test_admission_holds_turns_while_the_servers_queue_is_full_and_resumes_as_it_is_served() -> None:
    writer = QueueWriter()  # batches of 3 groups, 2 versions of staleness: at most 6 queued
    worker = _running(writer, RolloutWorkerConfig(max_staleness=2, admission_batch=3, write_interval_s=0.0))
    try:
        _held(worker)
        for _ in range(5):  # the trainer consumes a batch of 3 at a time: the worker refills, never past the bound
            holds = worker.admission_waits
            writer.serve(3)
            _wait(lambda h=holds: worker.admission_waits > h, timeout=60)  # refilled, then held again
        info = worker.info()
    finally:
        worker.stop()
    assert writer.served == 15 and len(writer.items) >= 20, "refilled after each batch served"
    assert writer.largest <= 6, "the queue never held more than max_staleness batches"
    assert info["admission_waits"] >= 6 and info["admission_wait_s"] > 0  # held once at first, then every cycle


def test_a_worker_counts_its_share_of_the_backlog_for_every_worker() -> None:
    writer = QueueWriter()
    config = RolloutWorkerConfig(max_staleness=2, admission_batch=3, backlog_share=3, write_interval_s=0.0)
    worker = _running(writer, config)
    try:
        _held(worker)
    finally:
        worker.stop()
    # a turn makes 1 item, counted for 3 workers: a turn starts while queued + 3 * 1 <= 6, so the last one starts
    # with 3 queued and the worker alone stops at 4
    assert writer.largest == 4 and len(writer.items) == 4


def test_a_worker_behind_the_trainers_version_admits_less_but_never_waits_on_an_empty_queue() -> None:
    writer = QueueWriter(version=1)  # the trainer published 1; the worker samples with 0: one version used up
    worker = _running(writer, RolloutWorkerConfig(max_staleness=2, admission_batch=3, write_interval_s=0.0))
    try:
        _held(worker)
    finally:
        worker.stop()
    assert writer.largest == 3  # (2 - 1) * 3

    writer = QueueWriter(version=2)  # as far behind as the bound allows: nothing fits, yet a queue short of a
    worker = _running(writer, RolloutWorkerConfig(max_staleness=2, admission_batch=3, write_interval_s=0.0))
    try:  # batch admits a turn (served at once, at the bound)
        _held(worker)
    finally:
        worker.stop()
    assert writer.largest == 3  # one batch, which the trainer can take


def test_a_starving_worker_further_behind_than_the_bound_waits_for_the_published_weights() -> None:
    writer = QueueWriter(version=5)  # the trainer published 5 and waits for groups; the worker still has 0
    worker = _running(writer, RolloutWorkerConfig(max_staleness=2, admission_batch=3, write_interval_s=0.0))
    try:
        assert _held(worker) == 0, "groups sampled with version 0 would be served 5 versions stale and dropped"
        worker.offer_weights(3, WeightUpdate(3, {"v": np.array(3.0)}))  # the push arrives: 2 behind, within
        _wait(lambda: len(writer.items) == 3, timeout=60)
        _held(worker)
    finally:
        worker.stop()
    assert writer.largest == 3 and all(item[0] == 3 for item in writer.items)


class TurnOfThreeManager(FakeManager):
    """Makes 3 items a turn, or ``max_examples`` if fewer (admission control's cap, as a group manager honours it)."""

    def sample_batch(self, request: SampleRequest) -> SampleResult:
        items = []
        for _ in range(3 if request.max_examples is None else min(3, request.max_examples)):
            items += super().sample_batch(request).items
        return SampleResult(items=items, env_steps=len(items), timings={"inference": 0.001})


def test_a_starving_worker_at_the_bound_makes_only_what_the_next_batch_takes_then_waits_for_new_weights() -> None:
    writer = QueueWriter(version=2)  # the trainer published 2; the worker samples with 0, as far behind as allowed
    config = RolloutWorkerConfig(max_staleness=2, admission_batch=3, write_interval_s=0.0)
    worker = RolloutWorker("w", TurnOfThreeManager, writer, config)
    worker.offer_weights(0, WeightUpdate(0, {"v": np.array(0.0)}))
    worker.start()
    try:
        _held(worker)
        assert len(writer.items) == 3  # one batch, which the trainer takes at version 2, at the bound
        writer.serve(2)  # one left: the trainer needs 2 more, and a whole turn of 3 would leave one for version 3
        _wait(lambda: len(writer.items) == 5, timeout=60)
        time.sleep(0.2)
        assert len(writer.items) == 5, "a group of version 0 served at version 3 would be dropped"
        assert worker.info()["capped_turns"] == 1 and worker.info()["weights_waits"] == 0
        writer.serve(3)  # the trainer took its batch at 2 and published 3: version 0 is now past the bound
        writer.version = 3
        _wait(lambda: worker.info()["weights_waits"] > 0, timeout=60)
        assert len(writer.items) == 5
        worker.offer_weights(3, WeightUpdate(3, {"v": np.array(3.0)}))  # the published weights arrive
        _wait(lambda: len(writer.items) == 8, timeout=60)
    finally:
        worker.stop()
    assert [item[0] for item in writer.items[:8]] == [0, 0, 0, 0, 0, 3, 3, 3]


def test_workers_whose_whole_turns_do_not_fit_make_smaller_ones_instead_of_waiting() -> None:
    """A worker of two at ``max_staleness = 0`` with turns of a whole batch: once it has made a whole turn it takes
    the other worker to have one under way too, so a whole turn of its own never fits the one batch the next version
    takes; it makes one group at a time instead of waiting ``stale_weights_wait_s`` (which a fleet of them once did
    for every batch)."""
    writer = QueueWriter(version=0)
    config = RolloutWorkerConfig(max_staleness=0, admission_batch=3, backlog_share=2, write_interval_s=0.0,
                                 stale_weights_wait_s=600.0)  # fmt: skip
    worker = RolloutWorker("w", TurnOfThreeManager, writer, config)
    worker.offer_weights(0, WeightUpdate(0, {"v": np.array(0.0)}))
    worker.start()
    try:
        _held(worker)
        assert len(writer.items) == 3  # a whole turn first: no turn made yet to take the other worker's size from
        for version in (1, 2):  # the trainer takes it and publishes; the worker makes the next batch
            writer.serve(3)
            writer.version = version
            worker.offer_weights(version, WeightUpdate(version, {"v": np.array(float(version))}))
            _wait(lambda v=version: len(writer.items) == 3 * (v + 1), timeout=60)
        time.sleep(0.2)
        info = worker.info()
    finally:
        worker.stop()
    assert [item[0] for item in writer.items] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # every group trained at its version
    assert info["weights_waits"] == 0 and writer.largest == 3
    assert info["capped_turns"] == 6  # versions 1 and 2: three turns of one group each


def test_a_starving_worker_budgets_against_the_version_the_trainer_trains_its_next_batch_at() -> None:
    """The trainer published 2 and took a batch at 2 that it is learning from: the next batch is trained at 3.
    A worker sampling with 0 would have every group of its turn served 3 versions stale, though it is only 2
    behind the published version: it waits for newer weights, then fills the queue."""
    writer = QueueWriter(version=2, next_version=3)
    config = RolloutWorkerConfig(max_staleness=2, admission_batch=3, write_interval_s=0.0)
    worker = _running(writer, config)
    try:
        _wait(lambda: worker.info()["weights_waits"] > 0, timeout=60)
        time.sleep(0.2)
        assert writer.items == [], "groups of version 0 trained at version 3 would be dropped"
        writer.version = 3  # the trainer published what it learnt; its weights reach the worker
        worker.offer_weights(3, WeightUpdate(3, {"v": np.array(3.0)}))
        _wait(lambda: len(writer.items) >= 3, timeout=60)
    finally:
        worker.stop()
    assert {item[0] for item in writer.items} == {3}


class LandingWriter(QueueWriter):
    """Writes land at the server while the worker reads the backlog: every write waits at a gate; ``backlog()``
    reports the queue as it is, then opens the gate and returns only once the worker has counted everything it made
    as sent (the interleaving in which a write in flight is seen by neither the server's count nor the worker's)."""

    def __init__(self, version: int, next_version: int) -> None:
        super().__init__(version, next_version)
        self.worker: RolloutWorker | None = None
        self.in_flight = threading.Event()
        self.gate = threading.Event()

    def write(self, items: list[Any]) -> None:
        self.in_flight.set()
        assert self.gate.wait(timeout=60)
        super().write(items)

    def backlog(self) -> Backlog:
        worker = self.worker
        assert worker is not None
        made = worker.manager.produced
        if made == len(self.items):
            return super().backlog()
        assert self.in_flight.wait(timeout=60)  # a turn's items are on their way
        seen = super().backlog()
        self.gate.set()
        _wait(lambda: worker.items_sent == made, timeout=60)
        self.gate.clear()
        self.in_flight.clear()
        return seen


def test_a_write_that_lands_while_the_backlog_is_read_is_counted_not_missed() -> None:
    """The trainer published 1 and learns from a batch (the next is trained at 2); the worker has 0, two behind the
    next batch. Its first turn (3 groups) fits: served at 2. A second turn would be served at 3, one past the bound;
    it must not start because the first turn's groups were in flight while the queue was read."""
    writer = LandingWriter(version=1, next_version=2)
    config = RolloutWorkerConfig(max_staleness=2, admission_batch=3, write_interval_s=0.0)
    worker = RolloutWorker("w", TurnOfThreeManager, writer, config)
    writer.worker = worker
    worker.offer_weights(0, WeightUpdate(0, {"v": np.array(0.0)}))
    worker.start()
    try:
        _held(worker)
    finally:
        writer.gate.set()
        worker.stop()
    assert len(writer.items) == 3, "a second turn of version 0 would be served at version 3 and dropped"


def test_a_worker_whose_newer_weights_never_come_samples_after_its_wait_and_says_so() -> None:
    writer = QueueWriter(version=5)
    config = RolloutWorkerConfig(max_staleness=2, admission_batch=3, write_interval_s=0.0, stale_weights_wait_s=0.2)
    worker = _running(writer, config)
    try:
        _wait(lambda: len(writer.items) == 3, timeout=60)
    finally:
        worker.stop()
    assert any("5 versions behind" in event for event in worker.info()["events"])


def test_a_stale_weights_wait_that_is_not_positive_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="stale_weights_wait_s"):
        RolloutWorkerConfig(stale_weights_wait_s=0)


class ShortTurnManager(FakeManager):
    """Makes 4 items a turn, except its second turn, which makes 3 (a prompt left out for an aborted completion)."""

    turns = 0

    def sample_batch(self, request: SampleRequest) -> SampleResult:
        self.turns += 1
        items = []
        for _ in range(3 if self.turns == 2 else 4):
            items += super().sample_batch(request).items
        return SampleResult(items=items, env_steps=len(items), timings={"inference": 0.001})


def test_a_queue_left_short_of_a_batch_is_filled_so_trainer_and_fleet_never_wait_on_each_other() -> None:
    writer = QueueWriter()  # batches of 4, 2 versions of staleness, 2 workers sharing the budget of 8
    config = RolloutWorkerConfig(max_staleness=2, admission_batch=4, backlog_share=2, write_interval_s=0.0)
    worker = RolloutWorker("w", ShortTurnManager, writer, config)
    worker.offer_weights(0, WeightUpdate(0, {"v": np.array(0.0)}))
    worker.start()
    try:
        # 4 queued + 2 x 4 of its own: held (once the first turn's 4 are written, so the trainer can take them)
        _wait(lambda: worker.admission_waits > 0 and len(writer.items) == 4, timeout=60)
        writer.serve(4)  # the trainer takes them; the next turn comes back one short: 3 queued
        # 3 + 2 x 3 does not fit 8, but the trainer cannot take a batch of 4 from 3: the worker makes another turn
        _wait(lambda: len(writer.items) >= 11, timeout=60)
    finally:
        worker.stop()
    assert worker.info()["state"] != "failed"
    assert len(writer.items) >= 11 and writer.queued() >= 4


def test_admission_needs_a_writer_that_reports_its_backlog_and_a_staleness_bound() -> None:
    config = RolloutWorkerConfig(max_staleness=2, admission_batch=4)
    with pytest.raises(ConfigError, match="admission_batch"):
        RolloutWorker("w", FakeManager, ListWriter(), config)
    with pytest.raises(ConfigError, match="backlog_share"):
        RolloutWorkerConfig(admission_batch=4, backlog_share=0)
    with pytest.raises(ConfigError, match="max_staleness"):
        RolloutWorkerConfig(max_staleness=None, admission_batch=4)
