"""Curriculum learning over lessons: smoothed success, sampling weights, dependency unlocking, graduation."""

from __future__ import annotations

from rollhub.curriculum.config import CurriculumConfig, CurriculumError, LessonConfig, LessonDependency
from rollhub.curriculum.curriculum import Curriculum, LessonStats, StatsMode
from rollhub.curriculum.shared import CurriculumLike, SharedCurriculum

__all__ = [
    "Curriculum",
    "CurriculumConfig",
    "CurriculumError",
    "CurriculumLike",
    "LessonConfig",
    "LessonDependency",
    "LessonStats",
    "SharedCurriculum",
    "StatsMode",
]
