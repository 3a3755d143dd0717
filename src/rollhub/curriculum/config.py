"""Lesson and curriculum settings: which environment each lesson runs, and how lessons depend on each other.

Settings are plain frozen dataclasses (no environment objects), so a curriculum can be built, checked and
shipped to a Ray actor before any environment is loaded. :meth:`CurriculumConfig.validate` guarantees unique
lesson ids, known dependencies and an acyclic dependency graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollhub.errors import ConfigError


class CurriculumError(ConfigError):
    """A curriculum that cannot work: unknown lesson, dependency cycle, threshold out of range."""


@dataclass(frozen=True, slots=True)
class LessonDependency:
    """Lesson ``lesson_id`` must reach ``threshold`` smoothed success (or plateau) before dependants unlock.

    Attributes:
        lesson_id: the lesson depended on.
        threshold: smoothed training success, in ``[0, 1]``, that satisfies the dependency.
        unlock_on_plateau: a dependency whose success has stopped improving also counts as satisfied.
    """

    lesson_id: str
    threshold: float = 0.8
    unlock_on_plateau: bool = True


@dataclass(frozen=True, slots=True)
class LessonConfig:
    """One lesson: an environment plus sampling sizes and graduation rule.

    Attributes:
        lesson_id: unique name.
        env_spec: ``"package.module:Class"`` of a group environment.
        env_args: keyword arguments for the environment's constructor.
        dependencies: lessons that must be satisfied before this one is sampled.
        n_examples: prompts per training batch.
        n_generations: completions per prompt (group size).
        graduate_threshold: evaluation success at which the lesson graduates (stops being sampled).
    """

    lesson_id: str
    env_spec: str
    env_args: dict[str, Any] = field(default_factory=dict)
    dependencies: tuple[LessonDependency, ...] = ()
    n_examples: int = 16
    n_generations: int = 8
    graduate_threshold: float = 0.95


@dataclass(frozen=True, slots=True)
class CurriculumConfig:
    """All lessons and the rules shared by them.

    Attributes:
        lessons: the lessons, in a stable order.
        smoothing: weight of the newest observation in the exponential moving average of success.
        exploration_bonus: extra sampling weight ``bonus / sqrt(1 + samples)`` for little-seen lessons.
        min_weight: floor of every active lesson's sampling weight, so none starves.
        plateau_window: number of recent training updates judged for a plateau.
        plateau_tolerance: a plateau is a window whose success range is at most this.
        eval_frequency: training batches between full evaluations (read by the worker).
        micro_eval_frequency: training batches between single-lesson evaluations (read by the worker).
        eval_n_examples: prompts per lesson in a full evaluation.
        micro_eval_n_examples: prompts in a micro evaluation.
    """

    lessons: tuple[LessonConfig, ...]
    smoothing: float = 0.1
    exploration_bonus: float = 0.5
    min_weight: float = 0.05
    plateau_window: int = 20
    plateau_tolerance: float = 0.02
    eval_frequency: int = 50
    micro_eval_frequency: int = 10
    eval_n_examples: int = 32
    micro_eval_n_examples: int = 8

    def __post_init__(self) -> None:
        self.validate()

    def lesson(self, lesson_id: str) -> LessonConfig:
        """The lesson named ``lesson_id``.

        Raises:
            CurriculumError: no such lesson.
        """
        for lesson in self.lessons:
            if lesson.lesson_id == lesson_id:
                return lesson
        known = [x.lesson_id for x in self.lessons]
        raise CurriculumError(f"unknown lesson {lesson_id!r}; known lessons are {known}")

    def validate(self) -> None:
        """Check ids, ranges and that dependencies form a DAG.

        Raises:
            CurriculumError: naming the offending lesson or cycle.
        """
        if not self.lessons:
            raise CurriculumError("a curriculum needs at least one lesson")
        ids = [x.lesson_id for x in self.lessons]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise CurriculumError(f"lesson ids {dupes} appear more than once; give each lesson a unique id")
        if not 0.0 < self.smoothing <= 1.0:
            raise CurriculumError(f"smoothing {self.smoothing} must be in (0, 1]")
        if self.plateau_window < 2:
            raise CurriculumError(f"plateau_window {self.plateau_window} must be at least 2")
        for lesson in self.lessons:
            for dep in lesson.dependencies:
                if dep.lesson_id not in ids:
                    raise CurriculumError(
                        f"lesson {lesson.lesson_id!r} depends on unknown lesson {dep.lesson_id!r}; "
                        f"known lessons are {ids}"
                    )
                if not 0.0 <= dep.threshold <= 1.0:
                    raise CurriculumError(f"dependency threshold {dep.threshold} must be in [0, 1]")
        _check_acyclic({x.lesson_id: [d.lesson_id for d in x.dependencies] for x in self.lessons})


def _check_acyclic(deps: dict[str, list[str]]) -> None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 2:
            return
        if state.get(node) == 1:
            cycle = [*path[path.index(node) :], node]
            raise CurriculumError(f"lesson dependencies form a cycle {' -> '.join(cycle)}; remove one edge")
        state[node] = 1
        for nxt in deps[node]:
            visit(nxt, [*path, node])
        state[node] = 2

    for node in deps:
        visit(node, [])
