"""Helpers shared by the group tests (a module of its own, so no conftest is imported by name)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from rollhub.curriculum import CurriculumConfig, LessonConfig, LessonDependency
from rollhub.inference.base import Completion, SamplingParams


def mock_curriculum(**mock_args) -> CurriculumConfig:
    """Two mock lessons: "easy" (3 prompts x 4 per batch) and "hard", which depends on "easy"."""
    return CurriculumConfig(
        lessons=(
            LessonConfig("easy", "mock", {"name": "easy", **mock_args}, n_examples=3, n_generations=4),
            LessonConfig("hard", "mock", {"name": "hard"}, dependencies=(LessonDependency("easy", 0.5),)),
        )
    )


class ScriptedPolicy:
    """An inference context that answers every prompt with the same completion ``"07"`` (then stop), except
    that the samples listed in ``aborted`` (``(prompt index, sample index)`` within one ``complete`` call) end
    with ``finish_reason="abort"``.

    Attributes:
        tokenizer: a marker an environment may read through the manager.
    """

    def __init__(self, aborted: Iterable[tuple[int, int]] = ()) -> None:
        self.aborted = set(aborted)
        self.tokenizer = "scripted"

    def complete(
        self, prompts: list[str], n: int, params: SamplingParams, rng: np.random.Generator
    ) -> list[list[Completion]]:
        return [
            [
                Completion((1, 2), (3, 4, 0), (-0.1, -0.2, -0.3), "07", "abort" if (i, k) in self.aborted else "stop")
                for k in range(n)
            ]
            for i in range(len(prompts))
        ]
