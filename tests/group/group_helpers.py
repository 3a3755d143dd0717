"""Helpers shared by the group tests (a module of its own, so no conftest is imported by name)."""

from __future__ import annotations

from rollhub.curriculum import CurriculumConfig, LessonConfig, LessonDependency


def mock_curriculum(**mock_args) -> CurriculumConfig:
    """Two mock lessons: "easy" (3 prompts x 4 per batch) and "hard", which depends on "easy"."""
    return CurriculumConfig(
        lessons=(
            LessonConfig("easy", "mock", {"name": "easy", **mock_args}, n_examples=3, n_generations=4),
            LessonConfig("hard", "mock", {"name": "hard"}, dependencies=(LessonDependency("easy", 0.5),)),
        )
    )
