"""Helpers for the tests of RolloutWorker driving GroupRolloutManagers (a module of its own, imported by name)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from rollhub.curriculum import CurriculumConfig, LessonConfig, LessonDependency
from rollhub.experience import Group
from rollhub.inference.tokenizer import CharTokenizer
from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer, TransformerConfig
from rollhub.rollout.group.manager import GroupRolloutManager
from rollhub.rollout.worker import RolloutWorker, WorkerState

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
    """An in-memory writer of groups, one list per ``write`` call (thread-safe)."""

    def __init__(self) -> None:
        self.groups: list[Group] = []
        self.closed = False
        self._lock = threading.Lock()

    def write(self, items: list[Any]) -> None:
        assert all(isinstance(g, Group) for g in items)
        with self._lock:
            self.groups.extend(items)

    def close(self) -> None:
        self.closed = True


def curriculum(eval_frequency: int = 0, micro_eval_frequency: int = 0) -> CurriculumConfig:
    """Two mock lessons: "easy" (3 prompts x 4 per training call) and "hard", unlocked by "easy"."""
    easy = LessonConfig("easy", "mock", {"name": "easy"}, n_examples=3, n_generations=4)
    locked = (LessonDependency("easy", 0.99, unlock_on_plateau=False),)  # "hard" stays locked: trains on "easy"
    hard = LessonConfig("hard", "mock", {"name": "hard"}, dependencies=locked)
    return CurriculumConfig(
        lessons=(easy, hard),
        eval_n_examples=2,
        micro_eval_n_examples=2,
        eval_frequency=eval_frequency,
        micro_eval_frequency=micro_eval_frequency,
    )


def weights(policy: LocalPolicy, marker: float) -> dict[str, np.ndarray]:
    """The policy's parameter shapes, every value ``marker`` (so a load is recognisable)."""
    return {k: np.full(tuple(v.shape), marker, dtype=np.float32) for k, v in policy.model.state_dict().items()}


def wait_for(predicate: Callable[[], bool], what: str, worker: RolloutWorker, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert worker.state is not WorkerState.FAILED, worker.error
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class ManagerFactory:
    """``worker_id -> GroupRolloutManager`` that keeps every manager it made."""

    def __init__(self, config: CurriculumConfig) -> None:
        self.config = config
        self.made: list[GroupRolloutManager] = []

    def __call__(self, worker_id: str) -> GroupRolloutManager:
        self.made.append(GroupRolloutManager(self.config, RecordingPolicy()))
        return self.made[-1]
