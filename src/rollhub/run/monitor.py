"""What a run does around its trainer's loop: metrics, trackers, progress, checkpoints, stopping.

:class:`MonitorBase` is what step and group runs share: the stop signals and the time limit before every
batch, one metrics row per update (``metrics.jsonl`` and every tracker), the progress line, a checkpoint every
``run.checkpoint_every`` updates, the update limit and the target, and the summary file. :class:`RunMonitor`
gives :func:`rollhub.train.ppo.train_ppo` its two hooks: ``stop_reason`` before every batch, and
``after_update`` after every published version (new episodes from the fleet's statistics, the row, the
progress line, the checkpoint, the target return and the update limit); the group run's monitor is
:class:`rollhub.run.group_monitor.GroupMonitor`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from abc import ABC, abstractmethod
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from rollhub.client.trackers import Tracker, make_tracker
from rollhub.rollout.protocols import EpisodeHistory
from rollhub.run.config import JsonlTrackerConfig, RunSection, TrackerConfig
from rollhub.run.progress import Progress, number, share
from rollhub.run.rundir import EPISODES, METRICS, SUMMARY, Resumed, RunDirectory
from rollhub.run.signals import StopSignals
from rollhub.train.ppo import PPOLearner, PPOState


def make_trackers(trackers: list[TrackerConfig], rundir: RunDirectory, name: str,
                  config: dict[str, Any]) -> list[Tracker]:  # fmt: skip
    """The ``[[trackers]]``, initialised with the run's ``name`` and its effective ``config`` (as plain data)."""
    out = []
    for spec in trackers:
        if isinstance(spec, JsonlTrackerConfig):
            tracker, project, group = make_tracker(f"jsonl:{rundir.root / spec.path}"), None, None
        else:
            tracker, project, group = make_tracker("wandb"), spec.project, spec.group
        tracker.init(project=project, group=group, name=name, config=config)
        out.append(tracker)
    return out


class MonitorBase(ABC):
    """What the monitors of step and group runs share; restores the shared counters from ``resumed``.

    Args:
        run: the ``[run]`` section (name, limits, checkpoints, progress line).
        rundir: the run directory.
        stop: the stop flag of SIGINT, SIGTERM and SIGHUP.
        trackers: the run's trackers (initialised; finished by :meth:`finish`).
        resumed: the checkpoint this session continues from, or ``None``.
        started: ``time.perf_counter()`` when the session started (default: now); ``run.max_seconds`` counts
            from it.
    """

    def __init__(self, run: RunSection, rundir: RunDirectory, stop: StopSignals, trackers: list[Tracker],
                 resumed: Resumed | None = None, started: float | None = None) -> None:  # fmt: skip
        self.run, self.rundir, self.stop, self.trackers = run, rundir, stop, trackers
        self.started = time.perf_counter() if started is None else started
        self.values: dict[str, Any] = resumed.values if resumed is not None else {}
        self.metric_rows = len(rundir.cut(METRICS, self.values.get("metric_rows", 0))) if resumed else 0
        self.elapsed_before = float(self.values.get("elapsed_s", 0.0))
        self.last_checkpoint = resumed.version if resumed else None
        self.bar = Progress(run.name) if run.progress else None

    # ---- what each run's monitor says -------------------------------------------------------------
    @property
    @abstractmethod
    def reached(self) -> bool:
        """Whether the run reached its target."""

    @abstractmethod
    def best_and_target(self) -> tuple[float, float | None]:
        """The best value so far of what the target measures, and the target (``None``: none)."""

    @abstractmethod
    def checkpoint_values(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The arrays and the values of a checkpoint of this moment."""

    # ---- shared -----------------------------------------------------------------------------------
    @property
    def session_s(self) -> float:
        """Seconds since this session started."""
        return time.perf_counter() - self.started

    @property
    def elapsed_s(self) -> float:
        """Seconds of training over every session of the run."""
        return self.elapsed_before + self.session_s

    @property
    def curve_png(self) -> Path:
        """Where the learning curve is drawn when the run ends."""
        return self.rundir.root / f"{self.run.name}_learning_curve.png"

    def stop_reason(self) -> str | None:
        """A stop signal or the time limit, else ``None``."""
        if self.stop.requested:
            return f"stopped by {self.stop.signal_name}"
        if self.session_s >= self.run.max_seconds:
            return "time limit"
        return None

    def log_update(self, row: dict[str, Any], version: int, fields: dict[str, object]) -> str | None:
        """One update's ``row`` (``metrics.jsonl`` and every tracker), the progress line with ``fields``, the
        checkpoint when due; return a reason to stop (target, update limit) or ``None``."""
        self.rundir.append(METRICS, [row])
        for tracker in self.trackers:
            tracker.log(row)
        self.metric_rows += 1
        if self.bar is not None:
            self.bar.update(self.fraction(version), **fields)
        if version % self.run.checkpoint_every == 0:
            self.checkpoint(version)
        if self.reached:
            return "target reached"
        if self.run.max_updates is not None and version >= self.run.max_updates:
            return "update limit"
        return None

    def checkpoint(self, version: int) -> None:
        """Save :meth:`checkpoint_values` as the checkpoint of ``version`` (once per version)."""
        if self.last_checkpoint == version:
            return
        arrays, values = self.checkpoint_values()
        self.rundir.save_checkpoint(version, arrays, values)
        self.last_checkpoint = version

    def fraction(self, version: int, with_time: bool = True) -> float:
        """Progress at ``version`` toward the nearest stopping condition (target, update limit and, ``with_time``,
        time limit)."""
        run = self.run
        best, target = self.best_and_target()
        shares = [share(self.session_s, run.max_seconds) if with_time else 0.0]
        if target is not None:
            shares.append(share(best, target))
        if run.max_updates is not None:
            shares.append(share(version, run.max_updates))
        return max(shares)

    def finish(self, reason: str, version: int, fields: dict[str, object]) -> None:
        """The final progress line (with ``fields``); trackers finished."""
        if self.bar is not None:
            done = self.reached or reason == "update limit"
            self.bar.close(reason, done, self.fraction(version, with_time=False), **fields)
        for tracker in self.trackers:
            tracker.finish()

    def write_summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write ``summary.json``; return ``summary``."""
        (self.rundir.root / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
        return summary


class RunMonitor(MonitorBase):
    """The hooks of one step-run session; restores its counters from ``resumed`` (and the run directory's files).

    Args:
        run: the ``[run]`` section.
        rundir: the run directory.
        learner: the learner whose state checkpoints hold.
        statistics: the fleet's episode statistics (``history(start)``; episodes of this session only).
        stop: the stop flag of SIGINT, SIGTERM and SIGHUP.
        trackers: the run's trackers.
        resumed: the checkpoint this session continues from, or ``None``.
        started: ``time.perf_counter()`` when the session started (default: now).
    """

    def __init__(
        self,
        run: RunSection,
        rundir: RunDirectory,
        learner: PPOLearner,
        statistics: EpisodeHistory,
        stop: StopSignals,
        trackers: list[Tracker] | None = None,
        resumed: Resumed | None = None,
        started: float | None = None,
    ) -> None:
        super().__init__(run, rundir, stop, trackers or [], resumed, started)
        self.learner, self.statistics = learner, statistics
        values = self.values
        earlier = rundir.cut(EPISODES, values.get("episodes", 0)) if resumed else []
        self.episode_count = len(earlier)  # rows in the episodes file (the curve is drawn from it at the end)
        self.env_steps = earlier[-1]["env_steps"] if earlier else 0
        self.episodes_missed = 0  # forgotten by the fleet's statistics before they were read (see _collect_episodes)
        self.best_mean_return = float(values.get("best_mean_return", 0.0))
        self.recent = deque((e["return"] for e in earlier), maxlen=run.window)
        self.session_episodes = 0  # the index, in the fleet's statistics, of the next episode to read
        self._reached = False
        self.state = PPOState()

    # ---- hooks of the loop ------------------------------------------------------------------------
    def after_update(self, state: PPOState, stats: dict[str, float]) -> str | None:
        """Record the update; checkpoint when due; return a reason to stop (target, update limit) or ``None``."""
        run = self.run
        self.state = state
        self._collect_episodes(state.version)
        mean = self.mean_return
        if len(self.recent) >= run.window:
            self.best_mean_return = max(self.best_mean_return, mean)
            self._reached = run.target_return is not None and mean >= run.target_return
        row = {
            "version": state.version,
            "trained_steps": state.trained_steps,
            "episodes": self.episode_count,
            "mean_return": round(mean, 4),
            "best_mean_return": round(self.best_mean_return, 4),
            "elapsed_s": round(self.elapsed_s, 3),
            **{k: round(v, 6) for k, v in stats.items()},
        }
        return self.log_update(row, state.version, self.fields(state, mean, stats.get("staleness", 0.0)))

    # ---- pieces -----------------------------------------------------------------------------------
    @property
    def reached(self) -> bool:
        """Whether the mean return over ``run.window`` episodes reached ``run.target_return``."""
        return self._reached

    @property
    def mean_return(self) -> float:
        """The mean return of the last ``run.window`` episodes (0 before any)."""
        return float(np.mean(self.recent)) if self.recent else 0.0

    def best_and_target(self) -> tuple[float, float | None]:
        """The best mean return and ``run.target_return``."""
        return self.best_mean_return, self.run.target_return

    def _collect_episodes(self, version: int) -> None:
        new = self.statistics.history(self.session_episodes)
        if not new:
            return
        self.episodes_missed += new[0].index - self.session_episodes  # only if reading fell far behind
        self.session_episodes = new[-1].index + 1
        env_steps = self.env_steps
        rows = []
        for episode in new:
            env_steps += episode.length
            rows.append(
                {
                    "index": self.episode_count + len(rows),
                    "env_steps": env_steps,
                    "return": float(episode.ret),
                    "length": int(episode.length),
                    "terminated": bool(episode.terminated),
                    "policy_version": int(episode.version),
                    "trainer_version": version,
                    "task": episode.task,
                }
            )
            self.recent.append(float(episode.ret))
        self.episode_count += len(rows)
        self.env_steps = env_steps
        self.rundir.append(EPISODES, rows)

    def checkpoint_values(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The learner, the loop's counters and this monitor's counters."""
        arrays, learner_values = self.learner.state_dict()
        values = {
            "learner": learner_values,
            "state": dataclasses.asdict(self.state),
            "episodes": self.episode_count,
            "metric_rows": self.metric_rows,
            "best_mean_return": self.best_mean_return,
            "elapsed_s": self.elapsed_s,
            "curriculum": None,  # the step path has no curriculum; a group run stores its state_dict here
        }
        return arrays, values

    def fields(self, state: PPOState, mean: float, staleness: float) -> dict[str, object]:
        """The fields of the progress line, the most telling first (a narrow line drops them from the end)."""
        return {
            "return": f"{number(mean)} (best {number(self.best_mean_return)})",
            "steps": number(state.trained_steps),
            "version": state.version,
            "stale": int(staleness),
        }

    def close(self, state: PPOState, reason: str) -> None:
        """Final checkpoint, final progress line, trackers finished."""
        self.state = state
        self.checkpoint(state.version)
        self.finish(reason, state.version, self.fields(state, self.mean_return, 0.0))
