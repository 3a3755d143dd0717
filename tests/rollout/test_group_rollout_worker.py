"""The shared RolloutWorker coordinating a GroupRolloutManager through GroupRolloutLoop (no Ray: a plain object)."""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rollhub.curriculum import Curriculum, CurriculumConfig, LessonConfig, LessonDependency
from rollhub.inference.tokenizer import CharTokenizer
from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer, TransformerConfig
from rollhub.rollout.file_writer import FileBatchWriter
from rollhub.rollout.group_loop import GroupLoopConfig, GroupLoopFactory
from rollhub.rollout.group_manager import GroupRolloutManager
from rollhub.rollout.group_writers import RolloutFileError, read_rollout_batches
from rollhub.rollout.worker import RolloutWorker, RolloutWorkerConfig, WorkerState
from rollhub.rollout_types import RolloutBatch
from rollhub.weights.base import WeightUpdate

torch.set_num_threads(1)


class RecordingPolicy(LocalPolicy):
    """A LocalPolicy that remembers the ``marker`` of every weight set loaded into it."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        tok = CharTokenizer()
        super().__init__(TinyTransformer(TransformerConfig(vocab_size=tok.vocab_size, d_model=16, n_heads=2)), tok)
        self.loaded: list[float] = []

    def load_weights(self, state: Mapping[str, Any]) -> None:
        super().load_weights(state)
        self.loaded.append(float(np.asarray(state["tok.weight"]).flat[0]))


class ListWriter:
    """An in-memory writer (thread-safe)."""

    def __init__(self) -> None:
        self.batches: list[RolloutBatch] = []
        self.closed = False
        self._lock = threading.Lock()

    def write(self, items: list[Any]) -> None:
        with self._lock:
            self.batches.extend(items)

    def close(self) -> None:
        self.closed = True


def curriculum() -> CurriculumConfig:
    easy = LessonConfig("easy", "mock", {"name": "easy"}, n_examples=3, n_generations=4)
    hard = LessonConfig("hard", "mock", {"name": "hard"}, dependencies=(LessonDependency("easy", 0.5),))
    return CurriculumConfig(lessons=(easy, hard), eval_n_examples=2)


def weights(policy: LocalPolicy, marker: float) -> dict[str, np.ndarray]:
    """The policy's parameter shapes, every value ``marker`` (so a load is recognisable)."""
    return {k: np.full(tuple(v.shape), marker, dtype=np.float32) for k, v in policy.model.state_dict().items()}


def wait_for(predicate: Callable[[], bool], what: str, worker: RolloutWorker, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert worker.state is not WorkerState.FAILED, worker.error
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def make_worker(tmp_path: Path, loop: GroupLoopConfig, **worker: Any) -> tuple[RolloutWorker, ListWriter, list[Any]]:
    writer, made = ListWriter(), []

    def manager_factory(worker_id: str) -> GroupRolloutManager:
        made.append(GroupRolloutManager(curriculum(), RecordingPolicy()))
        return made[-1]

    config = RolloutWorkerConfig(tracker=f"jsonl:{tmp_path}/{{worker_id}}.jsonl", **worker)
    return RolloutWorker("wA", GroupLoopFactory(manager_factory, loop), writer, config), writer, made


def tracker_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_worker_syncs_weights_into_the_manager_and_tags_batches_with_the_loaded_step(tmp_path: Path) -> None:
    worker, writer, made = make_worker(tmp_path, GroupLoopConfig())
    policy = made[0].inference
    assert isinstance(policy, RecordingPolicy)
    worker.start()
    time.sleep(0.05)
    assert writer.batches == [] and worker.state is WorkerState.WAITING_FOR_WEIGHTS  # nothing before weights
    worker.offer_weights(3, WeightUpdate(3, weights(policy, 0.25)))
    wait_for(lambda: len(writer.batches) >= 2, "batches at weight step 3", worker)
    worker.offer_weights(7, WeightUpdate(7, weights(policy, 0.5)))
    wait_for(lambda: writer.batches[-1].metadata.weight_step == 7, "a batch at weight step 7", worker)
    worker.stop()
    steps = [b.metadata.weight_step for b in writer.batches]
    assert steps == sorted(steps) and set(steps) == {3, 7}
    assert policy.loaded == [0.25, 0.5]  # update_model went through the manager to the policy, in order
    for batch in writer.batches:
        assert batch.lesson_id == "easy" and len(batch.groups) == 3
        assert {r.metadata for r in batch.rollouts} == {batch.metadata}
        assert batch.metadata.worker_id == "wA"
        assert {item["policy_version"] for item in batch.to_items()} == {batch.metadata.weight_step}


def test_eval_frequencies_max_rollouts_tracker_and_curriculum(tmp_path: Path) -> None:
    loop = GroupLoopConfig(eval_every=2, micro_eval_every=3, micro_eval_n_examples=2)
    worker, writer, made = make_worker(tmp_path, loop, max_rollouts=7)
    worker.offer_weights(1, WeightUpdate(1, weights(made[0].inference, 0.1)))
    worker.start()
    wait_for(lambda: worker.state is WorkerState.FINISHED, "max_rollouts", worker)
    wait_for(lambda: worker.items_sent == 7, "the sender to drain", worker)
    curriculum_ = made[0].curriculum
    assert isinstance(curriculum_, Curriculum)
    worker.stop()
    assert len(writer.batches) == 7 and worker.info()["rollouts"] == 7
    lines = tracker_lines(tmp_path / "wA.jsonl")
    assert lines[0]["event"] == "init" and lines[-1]["event"] == "finish"
    metrics = lines[1:-1]
    assert [m["turn"] for m in metrics] == list(range(7))
    assert [m["turn"] for m in metrics if "eval.easy.accuracy" in m] == [2, 4, 6]
    assert [m["turn"] for m in metrics if "micro_eval.easy.accuracy" in m] == [3, 6]
    assert all(m["eval.hard.n_rollouts"] == 2 for m in metrics if "eval.easy.accuracy" in m)  # every lesson
    assert all(m["micro_eval.easy.n_rollouts"] == 2 for m in metrics if "micro_eval.easy.accuracy" in m)
    assert all(m["weight_step"] == 1 and m["rollout.easy.n_rollouts"] == 12 for m in metrics)
    # full evaluations and training batches reached the curriculum; micro-evaluations did not
    assert curriculum_.stats["easy"].eval_step == 6 and curriculum_.stats["hard"].eval_step == 6
    assert curriculum_.stats["easy"].n_samples == 7 * 12
    assert worker.state is WorkerState.STOPPED and writer.closed
    with pytest.raises(Exception, match="shut down"):
        _ = made[0].inference


def test_stop_ends_a_running_worker_and_accounts_for_every_batch(tmp_path: Path) -> None:
    worker, writer, made = make_worker(tmp_path, GroupLoopConfig())
    worker.offer_weights(0, WeightUpdate(0, weights(made[0].inference, 0.0)))
    worker.start()
    wait_for(lambda: len(writer.batches) >= 3, "three batches", worker)
    worker.stop()
    assert worker.state is WorkerState.STOPPED
    assert not any(thread.is_alive() for thread in worker._threads)
    info = worker.info()
    assert info["items_sent"] == len(writer.batches) and info["items_unsent"] == 0
    assert info["rollouts"] == info["items_sent"] + info["items_unsent"]  # nothing produced went missing
    n = len(writer.batches)
    time.sleep(0.1)
    assert len(writer.batches) == n


def test_file_writer_keeps_every_batch_for_offline_evaluation(tmp_path: Path) -> None:
    made: list[GroupRolloutManager] = []

    def manager_factory(worker_id: str) -> GroupRolloutManager:
        made.append(GroupRolloutManager(curriculum(), RecordingPolicy()))
        return made[-1]

    writer = pickle.loads(pickle.dumps(FileBatchWriter(tmp_path / "rollouts-{pid}.jsonl")))
    worker = RolloutWorker("wF", GroupLoopFactory(manager_factory), writer, RolloutWorkerConfig(max_rollouts=4))
    worker.offer_weights(2, WeightUpdate(2, weights(made[0].inference, 0.3)))
    worker.start()
    wait_for(lambda: worker.state is WorkerState.FINISHED and worker.items_sent == 4, "four batches", worker)
    worker.stop()
    batches = list(read_rollout_batches(tmp_path / f"rollouts-{os.getpid()}.jsonl"))
    assert len(batches) == 4
    assert all(b.metadata.weight_step == 2 and b.metadata.worker_id == "wF" for b in batches)
    assert all(len(b.groups) == 3 and len(b.rollouts) == 12 for b in batches)
    with pytest.raises(RolloutFileError, match="RolloutBatch"):
        writer.write([{"tokens": [[1]]}])
    writer.close()
