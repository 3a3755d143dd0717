"""The one RolloutWorker driving a GroupRolloutManager (no Ray: plain objects): weights, staleness, the
evaluation schedule, max_rollouts, the tracker, and the run's shared curriculum."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from group_worker_fakes import ListWriter, ManagerFactory, RecordingPolicy, curriculum, wait_for, weights

from rollhub.curriculum import SharedCurriculum
from rollhub.envs.group.scored import group_info
from rollhub.errors import ConfigError
from rollhub.rollout.group.files import RolloutFileError, read_rollout_groups
from rollhub.rollout.protocols import SampleResult
from rollhub.rollout.worker import RolloutWorker, RolloutWorkerConfig, WorkerState
from rollhub.rollout.writers.file_writer import FileBatchWriter
from rollhub.weights.base import WeightUpdate
from rollhub.wire.group import group_to_item


def make_worker(
    tmp_path: Path, shared: SharedCurriculum, worker_id: str = "wA", **worker: Any
) -> tuple[RolloutWorker, ListWriter, ManagerFactory]:
    writer, factory = ListWriter(), ManagerFactory(shared.config)
    config = RolloutWorkerConfig(tracker=f"jsonl:{tmp_path}/{{worker_id}}.jsonl", **worker)
    return RolloutWorker(worker_id, factory, writer, config, curriculum=shared), writer, factory


def tracker_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_worker_syncs_weights_into_the_manager_and_tags_groups_with_the_loaded_version(tmp_path: Path) -> None:
    worker, writer, factory = make_worker(tmp_path, SharedCurriculum(curriculum()))
    policy = factory.made[0].inference
    assert isinstance(policy, RecordingPolicy)
    worker.start()
    assert writer.groups == [] and worker.state is WorkerState.WAITING_FOR_WEIGHTS  # nothing before weights
    worker.offer_weights(3, WeightUpdate(3, weights(policy, 0.25)))
    wait_for(lambda: len(writer.groups) >= 6, "groups at version 3", worker)
    worker.offer_weights(7, WeightUpdate(7, weights(policy, 0.5)))
    wait_for(lambda: writer.groups[-1].policy_version == 7, "a group at version 7", worker)
    worker.stop()
    versions = [g.policy_version for g in writer.groups]
    assert versions == sorted(versions) and set(versions) == {3, 7}
    assert policy.loaded == [0.25, 0.5]  # update_model went through the manager to the policy, in order
    for group in writer.groups:
        info = group_info(group)
        assert info["env_name"] == "easy" and info["worker_id"] == "wA" and group.size == 4
        assert group_to_item(group)["policy_version"] == group.policy_version


def test_eval_schedule_from_the_curriculum_config_max_rollouts_tracker_and_reports(tmp_path: Path) -> None:
    shared = SharedCurriculum(curriculum(eval_frequency=2, micro_eval_frequency=3))
    worker, writer, factory = make_worker(tmp_path, shared, max_rollouts=7)
    worker.offer_weights(1, WeightUpdate(1, weights(factory.made[0].inference, 0.1)))
    worker.start()
    wait_for(lambda: worker.state is WorkerState.FINISHED, "max_rollouts", worker)
    wait_for(lambda: worker.items_sent == 7 * 3, "the sender to drain", worker)
    worker.stop()
    assert len(writer.groups) == 21 and worker.info()["rollouts"] == 7  # evaluation groups are not stored
    lines = tracker_lines(tmp_path / "wA.jsonl")
    assert lines[0]["event"] == "init" and lines[-1]["event"] == "finish"
    metrics = lines[1:-1]
    assert [m["turn"] for m in metrics] == list(range(7))
    assert [m["turn"] for m in metrics if "eval.easy.accuracy" in m] == [2, 4, 6]
    assert [m["turn"] for m in metrics if "micro_eval.easy.accuracy" in m] == [3, 6]
    assert all(m["eval.hard.n_sequences"] == 2 for m in metrics if "eval.easy.accuracy" in m)  # every lesson
    assert all(m["micro_eval.easy.n_sequences"] == 2 for m in metrics if "micro_eval.easy.accuracy" in m)
    assert all(m["policy_version"] == 1 and m["rollout.easy.n_sequences"] == 12 for m in metrics)
    # full evaluations and training calls reached the curriculum; micro-evaluations did not
    stats = shared.curriculum.stats
    assert stats["easy"].eval_step == 6 and stats["hard"].eval_step == 6
    assert stats["easy"].n_samples == 7 * 12
    assert worker.state is WorkerState.STOPPED and writer.closed
    with pytest.raises(Exception, match="shut down"):
        _ = factory.made[0].inference


def test_two_workers_share_one_curriculum_and_both_report_to_it(tmp_path: Path) -> None:
    shared = SharedCurriculum(curriculum(eval_frequency=2))
    workers = [make_worker(tmp_path, shared, worker_id=w, max_rollouts=3)[:2] for w in ("wA", "wB")]
    for worker, _ in workers:
        worker.offer_weights(0, WeightUpdate(0, weights(RecordingPolicy(), 0.0)))
        worker.start()
    for worker, _ in workers:
        wait_for(lambda w=worker: w.state is WorkerState.FINISHED, "max_rollouts", worker)
        worker.stop()
    for worker, writer in workers:
        assert {group_info(g)["worker_id"] for g in writer.groups} == {worker.worker_id}
    stats = shared.curriculum.stats["easy"]
    assert stats.n_samples == 2 * 3 * 12  # three training calls of 12 sequences from each worker
    assert stats.eval_step == 2 and shared.curriculum.stats["hard"].eval_success is not None  # turn 2 of both


class ScriptedSubscriber:
    """Any WeightSubscriber: hands out one update, and reports a newer version on offer elsewhere."""

    def __init__(self, update: WeightUpdate, offered_version: int) -> None:
        self.update: WeightUpdate | None = update
        self.offered_version = offered_version
        self._loaded: int | None = None

    @property
    def loaded_version(self) -> int | None:
        return self._loaded

    def poll(self) -> WeightUpdate | None:
        update, self.update = self.update, None
        if update is not None:
            self._loaded = update.version
        return update


def test_worker_takes_any_weight_subscriber_and_honours_the_staleness_bound(tmp_path: Path) -> None:
    """Loaded version 4 with version 10 on offer and max_staleness 2: the floor is 8, so the manager samples
    nothing (it never produces stale groups) and the worker counts what was dropped."""
    shared = SharedCurriculum(curriculum())
    policy = RecordingPolicy()
    stale = ScriptedSubscriber(WeightUpdate(4, weights(policy, 0.4)), offered_version=10)
    writer, factory = ListWriter(), ManagerFactory(shared.config)
    worker = RolloutWorker("wS", factory, writer, RolloutWorkerConfig(max_staleness=2), None, shared, stale)
    with pytest.raises(ConfigError, match="subscriber"):
        worker.offer_weights(5, WeightUpdate(5, weights(policy, 0.5)))
    worker.start()
    wait_for(lambda: worker.dropped_groups >= 6, "dropped groups", worker)
    assert worker.info()["loaded_version"] == 4 and writer.groups == [] and worker.rollouts == 0
    worker.stop()
    assert any("older than min_version 8" in e for e in worker.events)
    fresh = ScriptedSubscriber(WeightUpdate(9, weights(policy, 0.9)), offered_version=10)
    worker = RolloutWorker(
        "wS", ManagerFactory(shared.config), writer, RolloutWorkerConfig(max_rollouts=1), None, shared, fresh
    )
    worker.start()
    wait_for(lambda: worker.state is WorkerState.FINISHED and worker.items_sent == 3, "fresh groups", worker)
    worker.stop()
    assert [g.policy_version for g in writer.groups] == [9, 9, 9]


def test_file_writer_keeps_every_group_for_offline_evaluation(tmp_path: Path) -> None:
    shared = SharedCurriculum(curriculum())
    factory = ManagerFactory(shared.config)
    writer = pickle.loads(pickle.dumps(FileBatchWriter(tmp_path / "rollouts-{pid}.jsonl")))
    worker = RolloutWorker("wF", factory, writer, RolloutWorkerConfig(max_rollouts=4), curriculum=shared)
    worker.offer_weights(2, WeightUpdate(2, weights(factory.made[0].inference, 0.3)))
    worker.start()
    wait_for(lambda: worker.state is WorkerState.FINISHED and worker.items_sent == 12, "twelve groups", worker)
    worker.stop()
    groups = [g for line in read_rollout_groups(tmp_path / f"rollouts-{os.getpid()}.jsonl") for g in line]
    assert len(groups) == 12 and all(g.size == 4 for g in groups)
    assert all(g.policy_version == 2 and group_info(g)["worker_id"] == "wF" for g in groups)
    with pytest.raises(RolloutFileError, match="Group objects"):
        writer.write([{"tokens": [[1]]}])
    writer.close()


class AbortingManager:
    """A group manager each of whose training calls left two groups out for an aborted completion."""

    def sample_batch(self, request: Any) -> SampleResult:
        return SampleResult(metrics={"aborted_completions": 3.0, "aborted_groups": 2.0})

    def update_model(self, weights: Any) -> None:
        """Nothing to load."""

    def shutdown(self) -> None:
        """Nothing to release."""


def test_worker_counts_the_groups_left_out_for_an_aborted_completion(tmp_path: Path) -> None:
    config = RolloutWorkerConfig(tracker=f"jsonl:{tmp_path}/{{worker_id}}.jsonl")
    worker = RolloutWorker("wX", lambda worker_id: AbortingManager(), ListWriter(), config)
    worker.start()
    worker.offer_weights(0, WeightUpdate(0, {}))
    wait_for(lambda: worker.aborted_groups >= 6, "aborted groups", worker)
    worker.stop()
    assert worker.aborted_groups % 2 == 0 and worker.info()["aborted_groups"] == worker.aborted_groups
    assert worker.items_sent == 0 and worker.dropped_groups == 0
