"""The curriculum: which lesson to sample next, judged from smoothed success.

Rules, each applied on every stats update:

- **Smoothed success**: an exponential moving average of training success per lesson (weight ``smoothing``
  on the newest batch); the first batch sets it directly.
- **Sampling weights**: for each active lesson (unlocked, not graduated) ``4 s (1 - s)``, which peaks at 50%
  success where a group's completions disagree most, plus ``exploration_bonus / sqrt(1 + samples)``, floored
  at ``min_weight``. Weights are normalised to sum to 1.
- **Unlocking**: a lesson unlocks once every dependency is satisfied: the dependency's smoothed success has
  reached its threshold, or (if allowed) its success has plateaued (the last ``plateau_window`` training
  updates span at most ``plateau_tolerance``), or it has graduated. Unlocking is permanent.
- **Graduation**: judged on evaluation only; a lesson whose evaluation success reaches its
  ``graduate_threshold`` graduates and is no longer sampled while any active lesson remains.

Everything is plain Python state with :meth:`Curriculum.state_dict` / :meth:`Curriculum.load_state_dict`, so
the same object runs in-process or inside a Ray actor (see :mod:`rollhub.curriculum.actor`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from rollhub.curriculum.config import CurriculumConfig, CurriculumError, LessonDependency

StatsMode = Literal["training", "eval"]


@dataclass(slots=True)
class LessonStats:
    """What the curriculum knows about one lesson.

    Attributes:
        smoothed_success: EMA of training success, None before any training batch.
        n_samples: training rollouts seen.
        history: the last ``plateau_window`` training successes (oldest first).
        eval_success: success of the latest evaluation, None before any.
        eval_step: step of the latest evaluation (-1 before any).
        unlocked_step: step at which the lesson unlocked (-1 while locked; 0 without dependencies).
        graduated_step: step at which it graduated (-1 while not graduated).
    """

    smoothed_success: float | None = None
    n_samples: int = 0
    history: list[float] = field(default_factory=list)
    eval_success: float | None = None
    eval_step: int = -1
    unlocked_step: int = -1
    graduated_step: int = -1


class Curriculum:
    """Lesson sampling, stats updates, unlocking and graduation over a validated :class:`CurriculumConfig`."""

    def __init__(self, config: CurriculumConfig) -> None:
        config.validate()
        self.config = config
        self.stats: dict[str, LessonStats] = {x.lesson_id: LessonStats() for x in config.lessons}
        self.step = 0
        for lesson in config.lessons:
            if not lesson.dependencies:
                self.stats[lesson.lesson_id].unlocked_step = 0

    # ---- queries -------------------------------------------------------------------------------------------

    def is_unlocked(self, lesson_id: str) -> bool:
        """Whether the lesson's dependencies have been satisfied (lessons without any start unlocked)."""
        return self._stats(lesson_id).unlocked_step >= 0

    def is_graduated(self, lesson_id: str) -> bool:
        """Whether an evaluation has reached the lesson's graduation threshold."""
        return self._stats(lesson_id).graduated_step >= 0

    @property
    def active_lessons(self) -> list[str]:
        """Unlocked lessons that have not graduated, in config order."""
        return [i for i in self.stats if self.is_unlocked(i) and not self.is_graduated(i)]

    @property
    def finished(self) -> bool:
        """True once every lesson has graduated."""
        return all(self.is_graduated(i) for i in self.stats)

    def is_plateaued(self, lesson_id: str) -> bool:
        """The last ``plateau_window`` training successes span at most ``plateau_tolerance``."""
        hist = self._stats(lesson_id).history
        window = self.config.plateau_window
        return len(hist) >= window and max(hist[-window:]) - min(hist[-window:]) <= self.config.plateau_tolerance

    def sampling_weights(self) -> dict[str, float]:
        """Normalised sampling weight of each lesson that can be sampled now (see the module rules).

        When every unlocked lesson has graduated, all unlocked lessons get the floor weight, so training
        can go on while the caller decides to stop.
        """
        cfg = self.config
        active = self.active_lessons or [i for i in self.stats if self.is_unlocked(i)]
        raw = {}
        for lesson_id in active:
            st = self.stats[lesson_id]
            s = 0.0 if st.smoothed_success is None else st.smoothed_success
            if self.is_graduated(lesson_id):
                raw[lesson_id] = cfg.min_weight
                continue
            w = 4.0 * s * (1.0 - s) + cfg.exploration_bonus / math.sqrt(1.0 + st.n_samples)
            raw[lesson_id] = max(w, cfg.min_weight)
        total = sum(raw.values())
        return {k: v / total for k, v in raw.items()}

    def sample_lesson(self, seed: int) -> str:
        """One lesson id drawn by :meth:`sampling_weights` (the same seed and state give the same lesson)."""
        weights = self.sampling_weights()
        ids = list(weights)
        rng = np.random.default_rng(seed)
        return ids[int(rng.choice(len(ids), p=np.fromiter(weights.values(), dtype=np.float64)))]

    def metrics(self) -> dict[str, float]:
        """Flat metrics for a tracker: per-lesson success, weight, unlocked and graduated flags."""
        weights = self.sampling_weights()
        out: dict[str, float] = {"curriculum.step": float(self.step)}
        for lesson_id, st in self.stats.items():
            p = f"curriculum.{lesson_id}."
            out[p + "smoothed_success"] = -1.0 if st.smoothed_success is None else st.smoothed_success
            out[p + "eval_success"] = -1.0 if st.eval_success is None else st.eval_success
            out[p + "weight"] = weights.get(lesson_id, 0.0)
            out[p + "unlocked"] = float(self.is_unlocked(lesson_id))
            out[p + "graduated"] = float(self.is_graduated(lesson_id))
        return out

    # ---- updates -------------------------------------------------------------------------------------------

    def update_lesson_stats(
        self, lesson_id: str, success: float, n_rollouts: int, mode: StatsMode, current_step: int
    ) -> None:
        """Fold one batch's success into a lesson, then apply the unlocking and graduation rules.

        Args:
            lesson_id: the lesson the batch came from.
            success: fraction of its rollouts that succeeded, in ``[0, 1]``.
            n_rollouts: rollouts in the batch.
            mode: ``"training"`` updates smoothed success and plateau history; ``"eval"`` the eval success.
            current_step: the caller's step counter (recorded with unlocks and graduations).

        Raises:
            CurriculumError: unknown lesson, success outside ``[0, 1]`` or an unknown mode.
        """
        st = self._stats(lesson_id)
        if not 0.0 <= success <= 1.0 or math.isnan(success):
            raise CurriculumError(f"success {success} for lesson {lesson_id!r} must be in [0, 1]")
        self.step = max(self.step, current_step)
        if mode == "training":
            a = self.config.smoothing
            st.smoothed_success = (
                success if st.smoothed_success is None else (1 - a) * st.smoothed_success + a * success
            )
            st.n_samples += n_rollouts
            st.history = [*st.history, success][-self.config.plateau_window :]
        elif mode == "eval":
            st.eval_success, st.eval_step = success, current_step
            threshold = self.config.lesson(lesson_id).graduate_threshold
            if success >= threshold and st.graduated_step < 0 and self.is_unlocked(lesson_id):
                st.graduated_step = current_step
        else:
            raise CurriculumError(f"mode {mode!r} must be 'training' or 'eval'")
        self._refresh_unlocks(current_step)

    def _dependency_met(self, dep: LessonDependency) -> bool:
        st = self.stats[dep.lesson_id]
        if st.graduated_step >= 0:
            return True
        # A lesson not trained yet counts as 0 success, so a zero threshold means "once it unlocks".
        if (st.smoothed_success or 0.0) >= dep.threshold:
            return True
        return dep.unlock_on_plateau and self.is_plateaued(dep.lesson_id)

    def _refresh_unlocks(self, step: int) -> None:
        # Repeat until nothing changes so a chain of satisfied dependencies unlocks in one update.
        changed = True
        while changed:
            changed = False
            for lesson in self.config.lessons:
                st = self.stats[lesson.lesson_id]
                if st.unlocked_step < 0 and all(
                    self.is_unlocked(d.lesson_id) and self._dependency_met(d) for d in lesson.dependencies
                ):
                    st.unlocked_step = step
                    changed = True

    def _stats(self, lesson_id: str) -> LessonStats:
        try:
            return self.stats[lesson_id]
        except KeyError:
            raise CurriculumError(f"unknown lesson {lesson_id!r}; known lessons are {list(self.stats)}") from None

    # ---- persistence ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: per-lesson stats and the step (plain JSON-able values)."""
        return {"step": self.step, "lessons": {k: asdict(v) for k, v in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`.

        Raises:
            CurriculumError: the saved lessons differ from this curriculum's.
        """
        saved = set(state["lessons"])
        if saved != set(self.stats):
            raise CurriculumError(
                f"saved curriculum has lessons {sorted(saved)} but this one has {sorted(self.stats)}; "
                "load it into a curriculum built from the same config"
            )
        self.step = int(state["step"])
        self.stats = {k: LessonStats(**{**v, "history": list(v["history"])}) for k, v in state["lessons"].items()}
