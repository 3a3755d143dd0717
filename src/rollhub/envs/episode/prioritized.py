"""Prioritized task sampling: draw the training tasks the policy still fails more often than those it solves.

Once GRPO solves a task every time, each group of it scores the same, its advantages are all zero and it teaches
nothing: a batch drawn uniformly from a pool the policy mostly solves is mostly wasted. :class:`PrioritizedTasks`
wraps an :class:`~rollhub.envs.episode.base.EpisodeEnv` and keeps, per training task id, whether its last
``window`` episodes were solved (the :class:`~rollhub.envs.episode.types.Outcome`'s ``correct``). A training draw
of ``n`` tasks asks the environment for ``candidates * n`` and keeps ``n`` of them without replacement, each with
weight ``max(floor, 1 - s)``, ``s`` being the task's recent success rate (a task never seen weighs 1): tasks solved
every time are still drawn now and then (``floor``), so one the policy forgets comes back. This is the
prioritized sampling of curriculum-based RL for reasoning (sample problem ``i`` in proportion to ``1 - s_i``),
done over candidates so that it works for any environment, whatever its pool.

Only training draws are weighted; held-out draws (``mode="eval"``) pass through unchanged and their outcomes are
not recorded. Outcomes judged elsewhere (an agent behind the capture gateway posting its own reward) are recorded
with :meth:`PrioritizedTasks.record`.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from rollhub.envs.episode.base import EpisodeEnv
from rollhub.envs.episode.episode import Episode
from rollhub.envs.episode.types import EnvReply, ModelTurn, Outcome, Task
from rollhub.envs.group.base import Mode
from rollhub.errors import ConfigError


class PrioritizedTasks:
    """``env`` with its training tasks drawn by how often the policy fails them (see the module docstring).

    Args:
        env: the environment whose tasks are drawn.
        candidates: how many candidate tasks per task drawn (>= 1; 1 draws as ``env`` does).
        floor: the weight of a task solved every time (0 < floor <= 1).
        window: how many of a task's latest episodes its success rate counts (>= 1).
    """

    def __init__(self, env: EpisodeEnv, candidates: int = 4, floor: float = 0.05, window: int = 8) -> None:
        if candidates < 1:
            raise ConfigError(f"candidates must be >= 1 task per task drawn, got {candidates}")
        if not 0 < floor <= 1:
            raise ConfigError(f"floor must be in (0, 1], got {floor}: the weight of a task solved every time")
        if window < 1:
            raise ConfigError(f"window must be >= 1 episode, got {window}")
        self.env = env
        self.name = env.name
        self.candidates = candidates
        self.floor = floor
        self.window = window
        self._solved: dict[str, deque[bool]] = {}
        self._training: set[str] = set()  # ids drawn for training: only their outcomes are recorded
        self._lock = threading.Lock()

    def tasks(self, n: int, mode: Mode, rng: np.random.Generator) -> list[Task]:
        """``n`` training tasks drawn by weight from ``candidates * n`` of ``env``'s; held-out ones as ``env``
        draws them."""
        if mode != "train":
            return self.env.tasks(n, mode, rng)
        pool = self.env.tasks(self.candidates * n, mode, rng)
        if len(pool) <= n:
            picked = pool
        else:
            weights = np.array([self.weight(t.id) for t in pool])
            picked = [pool[i] for i in rng.choice(len(pool), size=n, replace=False, p=weights / weights.sum())]
        with self._lock:
            self._training.update(t.id for t in picked)
        return picked

    def step(self, task: Task, episode: Episode, turn: ModelTurn) -> EnvReply:
        """``env``'s reply."""
        return self.env.step(task, episode, turn)

    def outcome(self, task: Task, episode: Episode) -> Outcome:
        """``env``'s judgement, recorded against the task when it was drawn for training."""
        judged = self.env.outcome(task, episode)
        if task.id in self._training:
            self.record(task.id, judged.correct)
        return judged

    def record(self, task_id: str, solved: bool) -> None:
        """Count one episode of ``task_id`` (solved or not) in its success rate."""
        with self._lock:
            self._solved.setdefault(task_id, deque(maxlen=self.window)).append(bool(solved))

    def success(self, task_id: str) -> float | None:
        """The share of the task's latest episodes solved (``None``: none recorded)."""
        with self._lock:
            seen = self._solved.get(task_id)
            return None if not seen else sum(seen) / len(seen)

    def weight(self, task_id: str) -> float:
        """The task's draw weight: ``max(floor, 1 - success)``, 1 for a task never recorded."""
        rate = self.success(task_id)
        return 1.0 if rate is None else max(self.floor, 1.0 - rate)

    def stats(self) -> dict[str, float]:
        """``tasks_seen`` (training tasks with an outcome) and ``tasks_solved`` (of those, the ones whose latest
        ``window`` episodes were all solved)."""
        with self._lock:
            rates = [sum(s) / len(s) for s in self._solved.values() if s]
        return {"tasks_seen": float(len(rates)), "tasks_solved": float(sum(r == 1.0 for r in rates))}
