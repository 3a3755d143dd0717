"""One curriculum per run, shared by every rollout worker of a fleet.

Workers talk to the curriculum through :class:`CurriculumLike`: :class:`SharedCurriculum` when the workers
run as threads of one process, :class:`~rollhub.curriculum.actor.RemoteCurriculum` (a Ray actor) when they
run as actors. Either way every worker's training and evaluation statistics reach the same lesson state, and
every worker samples its lessons from it.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from rollhub.curriculum.config import CurriculumConfig
from rollhub.curriculum.curriculum import Curriculum, StatsMode


class CurriculumLike(Protocol):
    """The calls a rollout worker makes on the run's curriculum.

    Attributes:
        config: the lessons and the evaluation schedule (``eval_frequency``, ``micro_eval_frequency``).
    """

    config: CurriculumConfig

    def sample_lesson(self, seed: int) -> str:
        """The lesson to sample next."""
        ...

    def update_lesson_stats(
        self, lesson_id: str, success: float, n_rollouts: int, mode: StatsMode, current_step: int
    ) -> None:
        """Fold one sampling call's success into a lesson."""
        ...

    def metrics(self) -> dict[str, float]:
        """Flat metrics for a tracker."""
        ...


class SharedCurriculum:
    """A :class:`Curriculum` several in-process workers may call at once (one lock around every call).

    Args:
        config: the lessons; the curriculum is built from it.
    """

    def __init__(self, config: CurriculumConfig) -> None:
        self.config = config
        self.curriculum = Curriculum(config)
        self._lock = threading.Lock()

    def sample_lesson(self, seed: int) -> str:
        """See :meth:`Curriculum.sample_lesson`."""
        with self._lock:
            return self.curriculum.sample_lesson(seed)

    def update_lesson_stats(
        self, lesson_id: str, success: float, n_rollouts: int, mode: StatsMode, current_step: int
    ) -> None:
        """See :meth:`Curriculum.update_lesson_stats`."""
        with self._lock:
            self.curriculum.update_lesson_stats(lesson_id, success, n_rollouts, mode, current_step)

    def metrics(self) -> dict[str, float]:
        """See :meth:`Curriculum.metrics`."""
        with self._lock:
            return self.curriculum.metrics()

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`Curriculum.state_dict`."""
        with self._lock:
            return self.curriculum.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See :meth:`Curriculum.load_state_dict`."""
        with self._lock:
            self.curriculum.load_state_dict(state)
