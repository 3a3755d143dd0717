"""The group sources and where the staleness bound is applied: ``train_grpo`` trains on every batch a source
serves. Against a ``rollhub serve`` with ``--max-staleness`` the server's guard drops stale groups and the source
serves the rest as they come; against a server without that guard (none, or no ``POST /policy-version`` as on
AtroposLib) the source applies the bound once, counts what it left out and acknowledges what it skipped. The
in-process source serves the same :class:`~rollhub.client.types.Batch` type, with its queue's own guard.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollhub.client.env import EnvClient, to_group
from rollhub.client.errors import RequestRejected
from rollhub.client.trainer import TrainerClient
from rollhub.client.types import Batch, QueueStatus
from rollhub.experience import Group
from rollhub.inference.torch_policy import TinyTransformer, TransformerConfig
from rollhub.run.child_server import ChildServer, start_server
from rollhub.run.sources import GroupQueue, InProcessGroupSource, ServerGroupSource
from rollhub.train.grpo import GRPOConfig, GRPOState, GRPOTrainer, train_grpo
from rollhub.wire.group import group_from_json

torch.set_num_threads(1)


def item(version: int | None) -> dict:
    return {
        "tokens": [[1, 5, 6, 7], [1, 5, 6, 8]],
        "masks": [[-100, -100, 6, 7], [-100, -100, 6, 8]],
        "scores": [0.0, 1.0],
        "inference_logprobs": [[1.0, 1.0, -2.0, -2.0], [1.0, 1.0, -2.0, -2.0]],
        "policy_version": version,
    }


def tiny_trainer(version: int) -> tuple[GRPOTrainer, list[int]]:
    torch.manual_seed(0)
    trainer = GRPOTrainer(TinyTransformer(TransformerConfig(vocab_size=20, d_model=16, n_heads=2)), GRPOConfig())
    trainer.step_count = version  # as if that many updates were published
    published: list[int] = []
    trainer.publish = lambda step, state: published.append(step)
    return trainer, published


def run_pairs(url: str, trainer: GRPOTrainer, source: ServerGroupSource, pairs: list[tuple[int, ...]],
              ) -> tuple[str, GRPOState, list[dict[str, float]]]:  # fmt: skip
    """``train_grpo`` with the groups of one tuple (of these versions; a pair is a batch of 4 sequences) sent
    before each pull."""
    env = EnvClient(url)
    registration = env.register_env(desired_name="t", group_size=2, max_token_length=8)
    assert registration is not None
    sent = iter(pairs)

    def feed() -> str | None:
        pair = next(sent, None)
        if pair is None:
            return "fed"
        env.send([to_group(item(v), registration.env_id) for v in pair])
        return None

    state, stats_seen = GRPOState(), []
    try:
        reason = train_grpo(trainer, source, state, stop_reason=feed,
                            after_update=lambda s, stats: stats_seen.append(stats), wait_s=5.0)  # fmt: skip
    finally:
        env.close()
    return reason, state, stats_seen


def registered(url: str) -> TrainerClient:
    client = TrainerClient(url)
    client.register(batch_size=4, max_token_len=8, num_steps=10)
    assert client.get_batch() is None  # the trainer has asked: environments may register
    return client


@pytest.fixture
def unguarded(tmp_path: Path) -> Iterator[ChildServer]:
    handle = start_server(f"sqlite:///{tmp_path / 'rollhub.db'}")  # no --max-staleness: no guard at the server
    yield handle
    handle.stop()


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[ChildServer]:
    handle = start_server(f"sqlite:///{tmp_path / 'rollhub.db'}", "--max-staleness", "2")
    yield handle
    handle.stop()


def test_a_guarded_servers_batches_are_trained_whole(guarded: ChildServer) -> None:
    """The server drops what is stale at the announced version; the source and the trainer drop nothing."""
    client = registered(guarded.url)
    trainer, published = tiny_trainer(5)
    source = ServerGroupSource(client, lease_s=0.5, max_staleness=2)
    # version 2 is stale at 5 (the server drops it), 3 and 4 are fresh; at version 6, 4 is 2 behind: fresh
    reason, state, stats_seen = run_pairs(guarded.url, trainer, source, [(2, 3, 4), (4, 6)])
    assert reason == "fed" and source.guarded is True
    assert published == [5, 6, 7] and trainer.policy_version == 7
    assert (source.stale_groups, source.batches_skipped, state.stale_groups, state.skipped) == (0, 0, 0, 0)
    assert state.batches == 2 and [s["stale_groups"] for s in stats_seen] == [0.0, 0.0]
    assert state.staleness == [2, 1, 2, 0] and state.max_staleness_seen == 2  # every served group trained
    assert state.trained_sequences == 8
    assert sum(client.status().raw["stale_dropped"].values()) == 1  # the guard: the version-2 group
    assert client.get_batch(wait_s=1.0) is None  # every batch was acknowledged: none comes back
    client.close()


def test_an_unguarded_servers_batches_are_bounded_once_by_the_source(unguarded: ChildServer) -> None:
    """Without a bound at the server the source applies the run's: stale groups are left out and counted, an
    all-stale batch is acknowledged and skipped without moving any clock."""
    client = registered(unguarded.url)
    trainer, published = tiny_trainer(5)
    source = ServerGroupSource(client, lease_s=0.5, max_staleness=2)
    sent = [(1, 4), (2, 3), (5, 6)]  # one stale, one fresh; both stale at version 6; both fresh
    reason, state, stats_seen = run_pairs(unguarded.url, trainer, source, sent)
    assert reason == "fed" and source.guarded is False
    assert published == [5, 6, 7] and client.status().policy_version == 7  # a skipped batch moves no clock
    assert [s["stale_groups"] for s in stats_seen] == [1.0, 2.0]
    assert (state.batches, state.skipped, state.stale_groups) == (3, 1, 3)
    assert (source.stale_groups, source.batches_skipped) == (3, 1)
    assert state.staleness == [1, 1, 0] and state.max_staleness_seen == 1
    assert client.get_batch(wait_s=1.0) is None  # the skipped batch was acknowledged too: none comes back
    client.close()


class NoVersionRouteClient:
    """A trainer client of a server without ``POST /policy-version`` (AtroposLib 0.4.0) serving prepared
    batches; it records acknowledgements and counts status requests."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches
        self.acked: list[str] = []
        self.status_calls = 0

    def get_batch(self, *, wait_s: float = 0.0, lease_s: float | None = None) -> Batch | None:
        return self.batches.pop(0) if self.batches else None

    def ack(self, batch_id: str) -> None:
        self.acked.append(batch_id)

    def publish_version(self, version: int) -> Any:
        raise RequestRejected("404 Not Found", status_code=404)

    def status(self) -> QueueStatus:
        self.status_calls += 1
        return QueueStatus(current_step=0, queue_size=0)


def group(version: int | None) -> Group:
    return group_from_json(item(version))


def test_a_server_without_the_version_route_is_bounded_by_the_source(caplog: pytest.LogCaptureFixture) -> None:
    batches = [
        Batch([group(3), group(1), group(None)], batch_id="a", step=0),  # at version 4 with bound 2: 1 is stale
        Batch([group(0), group(1)], batch_id="b", step=1),  # at version 5 both are stale: skipped
        Batch([group(4), group(5)], batch_id="c", step=2),
    ]
    client = NoVersionRouteClient(list(batches))
    source = ServerGroupSource(client, max_staleness=2)  # type: ignore[arg-type]
    source.publish_version(4)
    assert source.guarded is False and "no POST /policy-version" in caplog.text
    first = source.next_batch(0.0)
    assert isinstance(first, Batch) and first.batch_id == "a" and first.step == 0
    assert [g.policy_version for g in first] == [3, None]  # the bound applied once; unversioned groups always kept
    assert (source.stale_groups, source.batches_skipped) == (1, 0)
    source.ack()
    source.publish_version(5)
    assert source.next_batch(0.0) is None and client.acked == ["a", "b"]  # the all-stale batch: acknowledged
    assert (source.stale_groups, source.batches_skipped) == (3, 1)
    last = source.next_batch(0.0)
    assert last is batches[2]  # nothing stale: served as it came
    source.ack()
    assert client.acked == ["a", "b", "c"] and (source.stale_groups, source.batches_skipped) == (3, 1)
    assert client.status_calls == 0  # no route: nothing more to ask


def test_a_servers_looser_bound_leaves_the_source_to_apply_the_runs() -> None:
    class LooseServer(NoVersionRouteClient):
        def publish_version(self, version: int) -> Any:
            return None

        def status(self) -> QueueStatus:
            self.status_calls += 1
            return QueueStatus(current_step=0, queue_size=0, raw={"max_staleness": self.bound})

    for bound, guarded in [(None, False), (3, False), (2, True), (1, True)]:
        client = LooseServer([Batch([group(1), group(4)], batch_id="a")])
        client.bound = bound  # type: ignore[attr-defined]
        source = ServerGroupSource(client, max_staleness=2)  # type: ignore[arg-type]
        source.publish_version(4)
        source.publish_version(5)
        assert source.guarded is guarded and client.status_calls == 1, bound  # asked once
        served = source.next_batch(0.0)
        assert served is not None and len(served) == (2 if guarded else 1), bound


class FixedManager:
    """A rollout manager stand-in whose training calls each return prepared groups."""

    def __init__(self, turns: list[list[Group]]) -> None:
        self.turns = turns

    def sample_batch(self, request: Any) -> Any:
        return SimpleNamespace(items=self.turns.pop(0), stats=None, metrics={})

    def update_model(self, weights: Any) -> None:
        raise AssertionError("only versions are offered here")


def test_the_in_process_source_serves_a_batch_and_its_queue_guards_the_bound() -> None:
    from rollhub.curriculum import CurriculumConfig, SharedCurriculum
    from rollhub.curriculum.config import LessonConfig

    lessons = CurriculumConfig(lessons=(LessonConfig("l0", "unused:Env"),), eval_frequency=0, micro_eval_frequency=0)
    # the first turn makes two batches' worth: the second batch waits a version in the queue
    manager = FixedManager([[group(0), group(0), group(0), group(0)], [group(1), group(1)]])
    source = InProcessGroupSource(manager, SharedCurriculum(lessons), batch_size=4, max_staleness=0)  # type: ignore[arg-type]
    first = source.next_batch(0.0)
    assert isinstance(first, Batch) and [g.policy_version for g in first] == [0, 0]
    source.publish_version(1)  # the leftover version-0 groups are 1 behind: the queue's guard drops them
    assert (source.stale_groups, source.batches_skipped) == (2, 0)
    source.offer_version(1)
    second = source.next_batch(0.0)  # the queue is below a batch again: the next turn is sampled
    assert isinstance(second, Batch) and [g.policy_version for g in second] == [1, 1]
    assert source.loaded_version == 1 and manager.turns == []


def test_the_group_queue_serves_batches_and_drops_what_aged_past_its_bound() -> None:
    queue = GroupQueue(batch_size=4, max_staleness=1)
    queue.put([group(0), group(1), group(2), group(None)])
    queue.publish_version(2)  # version 0 is 2 behind
    assert queue.stale_dropped == 1
    batch = queue.next_batch()
    assert isinstance(batch, Batch) and [g.policy_version for g in batch] == [1, 2]
    assert queue.next_batch() is None  # one group of 2 sequences left: less than a batch
    unbounded = GroupQueue(batch_size=4)
    unbounded.put([group(0), group(0)])
    unbounded.publish_version(10)
    assert unbounded.stale_dropped == 0 and [g.policy_version for g in unbounded.next_batch() or []] == [0, 0]
