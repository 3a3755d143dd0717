"""The group half of the rollout worker's loop: how a :class:`RolloutWorker` drives a ``GroupRolloutManager``.

:class:`RolloutWorker` runs one loop for every kind of manager: poll weights -> ``manager.update_model``,
``sample_batch(SampleRequest)``, queue the items for the writer, log ``SampleResult.metrics``, stop at
``max_rollouts``. :class:`GroupRolloutLoop` plugs a :class:`~rollhub.rollout.group_manager.GroupRolloutManager`
into that loop by implementing the worker's manager protocol. Each call is one turn of the refactor plan's loop:

1. ask the curriculum (through the manager) for a lesson;
2. every ``micro_eval_every`` turns, ``evaluate_lesson(..., "micro_eval")`` on that lesson;
3. every ``eval_every`` turns, ``evaluate_curriculum`` over every lesson;
4. ``sample_batch(lesson, n_examples, n_generations, "train", rng, weight_step, worker_id)``;
5. ``update_training_stats``; return the batch as the one item to store, and the numbers to log.

The loop holds only coordination state (the turn counter and the random stream); everything computed comes
from the manager, and ``weight_step`` / ``worker_id`` come from the worker's request, never from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollhub.rollout.group_manager import GroupRolloutManager
from rollhub.rollout.protocols import SampleRequest, SampleResult
from rollhub.rollout_types import RolloutBatchStats


@dataclass(frozen=True)
class GroupLoopConfig:
    """Evaluation frequencies and sizes of the group loop.

    Attributes:
        eval_every: turns between full curriculum evaluations (0: never). Turn 0 never evaluates.
        micro_eval_every: turns between micro-evaluations of the lesson just drawn (0: never).
        eval_n_examples: prompts per lesson in a full evaluation (None: the curriculum's ``eval_n_examples``).
        micro_eval_n_examples: prompts in a micro-evaluation.
        seed: seed of the loop's random stream (combined with the worker id, so workers differ).
    """

    eval_every: int = 0
    micro_eval_every: int = 0
    eval_n_examples: int | None = None
    micro_eval_n_examples: int = 8
    seed: int = 0


def _stats_metrics(prefix: str, stats: RolloutBatchStats) -> dict[str, float]:
    return {
        f"{prefix}.{stats.lesson_id}.accuracy": stats.accuracy,
        f"{prefix}.{stats.lesson_id}.mean_reward": stats.mean_reward,
        f"{prefix}.{stats.lesson_id}.n_rollouts": float(stats.n_rollouts),
        f"{prefix}.{stats.lesson_id}.mean_response_tokens": stats.mean_response_tokens,
    }


class GroupRolloutLoop:
    """Adapts a :class:`GroupRolloutManager` to the :class:`RolloutWorker` (one call = one training batch).

    ``SampleResult.items`` holds the :class:`~rollhub.rollout_types.RolloutBatch` (writers such as
    :class:`~rollhub.rollout.http_writer.HttpWriter` turn it into scored-data items); ``SampleResult.metrics``
    holds the training batch's statistics, the environment's metrics and any evaluation done this turn.

    Args:
        manager: the manager that computes.
        worker_id: the worker this loop runs in (seeds the random stream).
        config: evaluation frequencies.
    """

    def __init__(self, manager: GroupRolloutManager, worker_id: str, config: GroupLoopConfig | None = None) -> None:
        self.manager = manager
        self.config = config or GroupLoopConfig()
        self.turn = 0
        self.evaluations: list[dict[str, float]] = []  # every evaluation's metrics, for inspection
        self._rng = np.random.default_rng([self.config.seed, *worker_id.encode()])

    def sample_batch(self, request: SampleRequest) -> SampleResult:
        """One turn: pick a lesson, evaluate if due, sample a training batch, report it to the curriculum."""
        cfg, turn = self.config, self.turn
        metrics: dict[str, float] = {"turn": float(turn)}
        lesson_id = self.manager.sample_lesson(int(self._rng.integers(2**31)))
        if cfg.micro_eval_every and turn > 0 and turn % cfg.micro_eval_every == 0:
            stats, _ = self.manager.evaluate_lesson(
                lesson_id,
                cfg.micro_eval_n_examples,
                "micro_eval",
                self._rng,
                turn,
                request.weight_step,
                request.worker_id,
            )
            metrics.update(self._record(_stats_metrics("micro_eval", stats)))
        if cfg.eval_every and turn > 0 and turn % cfg.eval_every == 0:
            n = cfg.eval_n_examples or self.manager.curriculum_config.eval_n_examples
            results = self.manager.evaluate_curriculum(n, self._rng, turn, request.weight_step, request.worker_id)
            evaluated: dict[str, float] = {}
            for stats, _ in results.values():
                evaluated.update(_stats_metrics("eval", stats))
            metrics.update(self._record(evaluated))
        lesson = self.manager.lesson(lesson_id)
        batch, env_metrics = self.manager.sample_batch(
            lesson_id,
            lesson.n_examples,
            lesson.n_generations,
            "train",
            self._rng,
            request.weight_step,
            request.worker_id,
        )
        self.turn += 1
        if batch is None:
            return SampleResult(events=[f"lesson {lesson_id} produced no groups"], metrics=metrics)
        self.manager.update_training_stats(lesson_id, batch, turn)
        metrics.update(_stats_metrics("rollout", RolloutBatchStats.of(batch, lesson_id)))
        metrics.update({f"env.{lesson_id}.{k}": float(v) for k, v in (env_metrics or {}).items()})
        return SampleResult(items=[batch], env_steps=len(batch.rollouts), metrics=metrics)

    def _record(self, metrics: dict[str, float]) -> dict[str, float]:
        self.evaluations.append(dict(metrics))
        return metrics

    def update_model(self, weights: Mapping[str, Any]) -> None:
        """Hand new weights to the manager."""
        self.manager.update_model(weights)

    def shutdown(self) -> None:
        """Shut the manager down."""
        self.manager.shutdown()


@dataclass(frozen=True)
class GroupLoopFactory:
    """A picklable ``worker_id -> GroupRolloutLoop`` for :class:`RolloutWorker` and :class:`RolloutFleet`.

    Attributes:
        manager_factory: builds the worker's :class:`GroupRolloutManager` inside the worker's process.
        config: evaluation frequencies shared by every worker.
    """

    manager_factory: Callable[[str], GroupRolloutManager]
    config: GroupLoopConfig = GroupLoopConfig()

    def __call__(self, worker_id: str) -> GroupRolloutLoop:
        return GroupRolloutLoop(self.manager_factory(worker_id), worker_id, self.config)
