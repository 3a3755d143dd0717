"""The curriculum as a shared Ray actor, behind the same calls as the in-process :class:`Curriculum`.

Several rollout workers share one curriculum: :func:`get_or_create_curriculum_actor` starts (or finds) one
named actor per run (:func:`start_curriculum_actor` an unnamed one, as a fleet does), and
:class:`RemoteCurriculum` gives the workers the in-process call signatures:
``sample_lesson`` waits for its answer, stats updates are sent without waiting (the worker never blocks on
bookkeeping). Ray is imported only when these are used.
"""

from __future__ import annotations

from typing import Any

from rollhub.curriculum.config import CurriculumConfig
from rollhub.curriculum.curriculum import Curriculum, StatsMode


def get_or_create_curriculum_actor(config: CurriculumConfig, name: str = "rollhub-curriculum") -> Any:
    """A handle to the named curriculum actor, created from ``config`` if no actor has that name yet."""
    import ray

    actor_cls = ray.remote(num_cpus=0)(Curriculum)
    return actor_cls.options(name=name, get_if_exists=True).remote(config)


def start_curriculum_actor(config: CurriculumConfig, **options: Any) -> Any:
    """A new, unnamed curriculum actor built from ``config`` (``options``: Ray actor options, e.g. placement)."""
    import ray

    return ray.remote(num_cpus=0)(Curriculum).options(**options).remote(config)


class RemoteCurriculum:
    """Calls a curriculum actor with the in-process :class:`Curriculum` signatures (picklable: it travels to
    every worker of a fleet, which then share the actor's one curriculum).

    Args:
        handle: the curriculum actor.
        config: the config the actor was built from (workers read the evaluation schedule from it).
    """

    def __init__(self, handle: Any, config: CurriculumConfig) -> None:
        self.handle = handle
        self.config = config

    def sample_lesson(self, seed: int) -> str:
        """The actor's :meth:`Curriculum.sample_lesson` (waits for the answer)."""
        import ray

        return ray.get(self.handle.sample_lesson.remote(seed))

    def update_lesson_stats(
        self, lesson_id: str, success: float, n_rollouts: int, mode: StatsMode, current_step: int
    ) -> None:
        """The actor's :meth:`Curriculum.update_lesson_stats`, sent without waiting (calls stay in order)."""
        self.handle.update_lesson_stats.remote(lesson_id, success, n_rollouts, mode, current_step)

    def metrics(self) -> dict[str, float]:
        """The actor's :meth:`Curriculum.metrics`."""
        import ray

        return ray.get(self.handle.metrics.remote())

    def state_dict(self) -> dict[str, Any]:
        """The actor's :meth:`Curriculum.state_dict` (after every update sent before it)."""
        import ray

        return ray.get(self.handle.state_dict.remote())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the actor's curriculum (waits until done)."""
        import ray

        ray.get(self.handle.load_state_dict.remote(state))
