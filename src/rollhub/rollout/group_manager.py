"""The group rollout manager: it computes (inference, environments, curriculum) and never coordinates.

:class:`GroupRolloutManager` is the refactor plan's ``RolloutManager`` for group (LLM-style) environments. Its
methods take everything that varies between calls as arguments (``weight_step``, ``worker_id``, ``rng``,
``step``), so a test can call ``sample_batch`` with no worker, no weight transport and no storage, and any
``RolloutWorker`` can drive it: sync weights -> :meth:`update_model`, pick a lesson -> :meth:`sample_lesson`,
produce -> :meth:`sample_batch`, report -> :meth:`update_training_stats`, evaluate -> :meth:`evaluate_lesson`
or :meth:`evaluate_curriculum`, stop -> :meth:`shutdown`. The worker logs and stores what these return.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

import numpy as np

from rollhub.curriculum.config import CurriculumConfig, LessonConfig
from rollhub.curriculum.curriculum import Curriculum, StatsMode
from rollhub.envs.group.base import GroupEnv, Mode
from rollhub.envs.group.spec import load_environment_from_spec
from rollhub.errors import RollhubError
from rollhub.inference.base import InferenceContext
from rollhub.rollout_types import RolloutBatch, RolloutBatchStats, RolloutGroup, RolloutMetadata

logger = logging.getLogger(__name__)

EvalType = Literal["eval", "micro_eval"]
RngLike = np.random.Generator | int


class ManagerError(RollhubError):
    """A call the manager cannot serve: a policy without weight swapping, or a manager already shut down."""


class CurriculumLike(Protocol):
    """The calls the manager makes on a curriculum: in-process :class:`Curriculum` or ``RemoteCurriculum``."""

    def sample_lesson(self, seed: int) -> str:
        """The lesson to sample next."""
        ...

    def update_lesson_stats(
        self, lesson_id: str, success: float, n_rollouts: int, mode: StatsMode, current_step: int
    ) -> None:
        """Fold one batch's success into a lesson."""
        ...

    def metrics(self) -> dict[str, float]:
        """Flat metrics for a tracker."""
        ...


def _rng(rng: RngLike) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


class GroupRolloutManager:
    """Samples groups from curriculum lessons with one policy, and keeps the curriculum up to date.

    Args:
        curriculum_config: the lessons (each names its environment by spec) and evaluation sizes.
        inference: the policy; :meth:`update_model` needs it to have ``load_weights(state)``.
        curriculum: a shared curriculum (e.g. ``RemoteCurriculum`` over a Ray actor); a private in-process
            :class:`Curriculum` is built from ``curriculum_config`` when None.
        env_loader: builds an environment from ``(spec, args)``; environments are built once per lesson.
    """

    def __init__(
        self,
        curriculum_config: CurriculumConfig,
        inference: InferenceContext,
        curriculum: CurriculumLike | None = None,
        env_loader: Callable[[str, dict[str, Any]], GroupEnv] = load_environment_from_spec,
    ) -> None:
        self.curriculum_config = curriculum_config
        self.curriculum: CurriculumLike = curriculum if curriculum is not None else Curriculum(curriculum_config)
        self._inference: InferenceContext | None = inference
        self._env_loader = env_loader
        self._environments: dict[str, GroupEnv] = {}

    # ---- environments and lessons ----------------------------------------------------------------------

    def lesson(self, lesson_id: str) -> LessonConfig:
        """The lesson's settings (``n_examples`` and ``n_generations`` are what a training batch uses)."""
        return self.curriculum_config.lesson(lesson_id)

    def sample_lesson(self, seed: int) -> str:
        """The lesson to train on next, drawn by the curriculum."""
        return self.curriculum.sample_lesson(seed)

    def _load_environment(self, lesson_id: str) -> GroupEnv:
        env = self._environments.get(lesson_id)
        if env is None:
            lesson = self.lesson(lesson_id)
            env = self._env_loader(lesson.env_spec, dict(lesson.env_args))
            self._environments[lesson_id] = env
        return env

    @property
    def inference(self) -> InferenceContext:
        """The policy (raises :class:`ManagerError` after :meth:`shutdown`)."""
        if self._inference is None:
            raise ManagerError("the manager was shut down; build a new GroupRolloutManager")
        return self._inference

    # ---- producing -------------------------------------------------------------------------------------

    def sample_batch(
        self,
        lesson_id: str,
        n_examples: int,
        n_generations: int,
        mode: Mode,
        rng: RngLike,
        weight_step: int,
        worker_id: str,
    ) -> tuple[RolloutBatch | None, dict[str, float] | None]:
        """Sample ``n_examples`` groups of ``n_generations`` from a lesson, metadata on every rollout.

        Returns:
            ``(batch, env_metrics)``; ``(None, None)`` when the environment produced no groups.
        """
        env = self._load_environment(lesson_id)
        groups, metrics = env.sample(self.inference, n_examples, n_generations, mode, _rng(rng))
        if not groups:
            logger.warning("lesson %s produced no groups at weight step %d", lesson_id, weight_step)
            return None, None
        metadata = RolloutMetadata(worker_id=worker_id, timestamp=time.time(), weight_step=weight_step)
        stamped = tuple(RolloutGroup(tuple(r.with_metadata(metadata) for r in g.rollouts)) for g in groups)
        return RolloutBatch(groups=stamped, metadata=metadata, lesson_id=lesson_id), dict(metrics)

    def evaluate_lesson(
        self,
        lesson_id: str,
        n_examples: int,
        eval_type: EvalType,
        rng: RngLike,
        step: int,
        weight_step: int,
        worker_id: str,
    ) -> tuple[RolloutBatchStats, RolloutBatch]:
        """Evaluate one lesson (one greedy completion per prompt); only ``"eval"`` updates the curriculum.

        A lesson that produced nothing gives stats with ``n_rollouts == 0`` and an empty batch, and leaves
        the curriculum untouched.
        """
        batch, _ = self.sample_batch(lesson_id, n_examples, 1, "eval", rng, weight_step, worker_id)
        if batch is None:
            meta = RolloutMetadata(worker_id=worker_id, timestamp=time.time(), weight_step=weight_step)
            batch = RolloutBatch(groups=(), metadata=meta, lesson_id=lesson_id)
        stats = RolloutBatchStats.of(batch, lesson_id)
        if eval_type == "eval" and stats.n_rollouts:
            self.curriculum.update_lesson_stats(lesson_id, stats.accuracy, stats.n_rollouts, "eval", step)
        return stats, batch

    def evaluate_curriculum(
        self, eval_n_examples: int, rng: RngLike, step: int, weight_step: int, worker_id: str
    ) -> dict[str, tuple[RolloutBatchStats, RolloutBatch]]:
        """Evaluate every lesson (updating the curriculum); returns ``{lesson_id: (stats, batch)}``."""
        gen = _rng(rng)
        return {
            lesson.lesson_id: self.evaluate_lesson(
                lesson.lesson_id, eval_n_examples, "eval", gen, step, weight_step, worker_id
            )
            for lesson in self.curriculum_config.lessons
        }

    def update_training_stats(self, lesson_id: str, batch: RolloutBatch, step: int) -> None:
        """Fold a training batch into the curriculum.

        Training success is the batch's mean reward clipped to ``[0, 1]``: with partial-credit rewards a
        lesson whose exact accuracy is still 0 can already be learning, and the curriculum should see that
        (for 0/1 rewards it is the success rate). Graduation is judged on exact accuracy in evaluation.
        """
        stats = RolloutBatchStats.of(batch, lesson_id)
        if stats.n_rollouts:
            success = min(max(stats.mean_reward, 0.0), 1.0)
            self.curriculum.update_lesson_stats(lesson_id, success, stats.n_rollouts, "training", step)

    # ---- lifecycle -------------------------------------------------------------------------------------

    def update_model(self, model: Mapping[str, Any]) -> None:
        """Swap the policy's weights in place (``model`` is a state dict of tensors or arrays).

        Raises:
            ManagerError: the policy cannot swap weights (a remote server reloads its own).
        """
        load = getattr(self.inference, "load_weights", None)
        if load is None:
            raise ManagerError(
                f"{type(self.inference).__name__} cannot load weights in place; have the inference server "
                "reload from a checkpoint directory instead"
            )
        load(model)

    def shutdown(self) -> None:
        """Release the policy and environments; later calls raise :class:`ManagerError`."""
        close = getattr(self._inference, "close", None)
        if close is not None:
            close()
        self._inference = None
        self._environments.clear()
