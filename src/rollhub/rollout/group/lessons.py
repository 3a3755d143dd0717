"""The worker's curriculum duties on the group path: which lesson each turn samples, when to evaluate, and
what to report back to the run's shared curriculum.

A :class:`LessonPlan` is held by a :class:`~rollhub.rollout.worker.RolloutWorker` (coordination), never by a
manager (computation). Each turn of the worker's loop:

1. draw a lesson from the curriculum (seeded from the worker's random stream);
2. every ``micro_eval_frequency`` turns (from ``CurriculumConfig``), a micro-evaluation of that lesson
   (``micro_eval_n_examples`` greedy completions; logged, never reported to the curriculum);
3. every ``eval_frequency`` turns, a full evaluation of every lesson (``eval_n_examples`` each; reported as
   ``"eval"``, which is what graduation is judged on);
4. the training call on the lesson (reported as ``"training"``; its groups are what the worker stores).

Turn 0 never evaluates; a frequency of 0 never does.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from rollhub.curriculum.shared import CurriculumLike
from rollhub.envs.group.scored import GroupStats
from rollhub.rollout.protocols import SampleRequest, SampleResult

CallKind = Literal["train", "eval", "micro_eval"]


def _due(frequency: int, turn: int) -> bool:
    return frequency > 0 and turn > 0 and turn % frequency == 0


class LessonPlan:
    """Plans one worker's sampling calls from the shared curriculum and reports their statistics to it.

    Args:
        curriculum: the run's curriculum (:class:`~rollhub.curriculum.SharedCurriculum` in process,
            :class:`~rollhub.curriculum.actor.RemoteCurriculum` over Ray).
        worker_id: seeds the worker's random stream together with ``seed``, so workers draw differently.
        seed: the run's seed.
    """

    def __init__(self, curriculum: CurriculumLike, worker_id: str, seed: int = 0) -> None:
        self.curriculum = curriculum
        self.config = curriculum.config
        self._rng = np.random.default_rng([seed, *worker_id.encode()])

    def _seed(self) -> int:
        return int(self._rng.integers(2**31))

    def plan(
        self, turn: int, policy_version: int, worker_id: str, min_version: int | None
    ) -> list[tuple[CallKind, SampleRequest]]:
        """The calls of turn ``turn``, in order: evaluations that are due, then the training call."""
        cfg = self.config
        lesson_id = self.curriculum.sample_lesson(self._seed())

        def request(lesson: str, kind: CallKind, n_examples: int | None) -> tuple[CallKind, SampleRequest]:
            mode = "train" if kind == "train" else "eval"
            return kind, SampleRequest(policy_version, worker_id, min_version, lesson, mode, n_examples, self._seed())

        calls: list[tuple[CallKind, SampleRequest]] = []
        if _due(cfg.micro_eval_frequency, turn):
            calls.append(request(lesson_id, "micro_eval", cfg.micro_eval_n_examples))
        if _due(cfg.eval_frequency, turn):
            calls += [request(lesson.lesson_id, "eval", cfg.eval_n_examples) for lesson in cfg.lessons]
        calls.append(request(lesson_id, "train", None))
        return calls

    def report(self, kind: CallKind, request: SampleRequest, result: SampleResult, turn: int) -> dict[str, float]:
        """Send a call's statistics to the curriculum and return what the worker logs for it.

        Training success is the mean reward clipped to ``[0, 1]``: with partial-credit rewards a lesson whose
        exact accuracy is still 0 can already be learning, and the curriculum should see that (for 0/1 rewards
        it is the success rate). Evaluation success is exact accuracy, which graduation is judged on. Calls
        that produced nothing are not reported.
        """
        lesson_id = request.lesson_id or ""
        stats = result.stats or GroupStats.of([], lesson_id)
        if stats.n_sequences and kind == "train":
            success = min(max(stats.mean_reward, 0.0), 1.0)
            self.curriculum.update_lesson_stats(lesson_id, success, stats.n_sequences, "training", turn)
        elif stats.n_sequences and kind == "eval":
            self.curriculum.update_lesson_stats(lesson_id, stats.accuracy, stats.n_sequences, "eval", turn)
        metrics = stats.metrics("rollout" if kind == "train" else kind)
        if kind == "train":
            metrics.update({f"env.{lesson_id}.{k}": float(v) for k, v in result.metrics.items()})
        return metrics
