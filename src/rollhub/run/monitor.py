"""What a run does around its trainer's loop: episodes, metrics, trackers, progress, checkpoints, stopping.

:class:`RunMonitor` gives :func:`rollhub.train.ppo.train_ppo` its two hooks: ``stop_reason`` (signals, the
time limit) before every batch, and ``after_update`` after every published version (new episodes from the
fleet's statistics actor, one metrics row, the progress line, a checkpoint every ``run.checkpoint_every``
updates, the target return and the update limit).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

import numpy as np

from rollhub.client.trackers import Tracker, make_tracker
from rollhub.run.config import JsonlTrackerConfig, RunConfig
from rollhub.run.progress import Progress, number, share
from rollhub.run.rundir import EPISODES, METRICS, Resumed, RunDirectory
from rollhub.run.signals import StopSignals
from rollhub.train.ppo import PPOLearner, PPOState


def make_trackers(config: RunConfig, rundir: RunDirectory) -> list[Tracker]:
    """The configured trackers, initialised with the run's name and effective config."""
    trackers = []
    for spec in config.trackers:
        if isinstance(spec, JsonlTrackerConfig):
            tracker, project, group = make_tracker(f"jsonl:{rundir.root / spec.path}"), None, None
        else:
            tracker, project, group = make_tracker("wandb"), spec.project, spec.group
        tracker.init(project=project, group=group, name=config.run.name, config=config.model_dump(mode="json"))
        trackers.append(tracker)
    return trackers


def write_metrics_row(rundir: RunDirectory, trackers: list[Tracker], row: dict[str, Any]) -> None:
    """One update's row: appended to ``metrics.jsonl`` and logged to every tracker."""
    rundir.append(METRICS, [row])
    for tracker in trackers:
        tracker.log(row)


class RunMonitor:
    """The hooks of one run session; restores its counters from ``resumed`` (and the run directory's files).

    Args:
        config: the effective config.
        rundir: the run directory.
        learner: the learner whose state checkpoints hold.
        statistics: the fleet's episode statistics (``history(start)``; episodes of this session only).
        stop: the stop flag of SIGINT, SIGTERM and SIGHUP.
        resumed: the checkpoint this session continues from, or ``None``.
        started: ``time.perf_counter()`` when the session started (default: now); ``run.max_seconds`` counts
            from it.
    """

    def __init__(
        self,
        config: RunConfig,
        rundir: RunDirectory,
        learner: PPOLearner,
        statistics: Any,
        stop: StopSignals,
        resumed: Resumed | None = None,
        started: float | None = None,
    ) -> None:
        self.config, self.rundir, self.learner, self.statistics, self.stop = config, rundir, learner, statistics, stop
        self.started = time.perf_counter() if started is None else started
        values = resumed.values if resumed is not None else {}
        earlier = rundir.cut(EPISODES, values.get("episodes", 0)) if resumed else []
        self.episode_count = len(earlier)  # rows in the episodes file (the curve is drawn from it at the end)
        self.env_steps = earlier[-1]["env_steps"] if earlier else 0
        self.episodes_missed = 0  # forgotten by the fleet's statistics before they were read (see _collect_episodes)
        self.metric_rows = len(rundir.cut(METRICS, values.get("metric_rows", 0))) if resumed else 0
        self.best_mean_return = float(values.get("best_mean_return", 0.0))
        self.elapsed_before = float(values.get("elapsed_s", 0.0))
        self.recent = deque((e["return"] for e in earlier), maxlen=config.run.window)
        self.session_episodes = 0  # the index, in the fleet's statistics, of the next episode to read
        self.last_checkpoint = resumed.version if resumed else None
        self.reached = False
        self.trackers = make_trackers(config, rundir)
        self.bar = Progress(config.run.name) if config.run.progress else None

    # ---- hooks of the loop ------------------------------------------------------------------------
    def stop_reason(self) -> str | None:
        """A stop signal or the time limit, else ``None``."""
        if self.stop.requested:
            return f"stopped by {self.stop.signal_name}"
        if self.session_s >= self.config.run.max_seconds:
            return "time limit"
        return None

    def after_update(self, state: PPOState, stats: dict[str, float]) -> str | None:
        """Record the update; checkpoint when due; return a reason to stop (target, update limit) or ``None``."""
        run = self.config.run
        self._collect_episodes(state.version)
        mean = float(np.mean(self.recent)) if self.recent else 0.0
        if len(self.recent) >= run.window:
            self.best_mean_return = max(self.best_mean_return, mean)
            self.reached = run.target_return is not None and mean >= run.target_return
        row = {
            "version": state.version,
            "trained_steps": state.trained_steps,
            "episodes": self.episode_count,
            "mean_return": round(mean, 4),
            "best_mean_return": round(self.best_mean_return, 4),
            "elapsed_s": round(self.elapsed_before + self.session_s, 3),
            **{k: round(v, 6) for k, v in stats.items()},
        }
        write_metrics_row(self.rundir, self.trackers, row)
        self.metric_rows += 1
        if self.bar is not None:
            self.bar.update(self.fraction(state.version), **self.fields(state, mean, stats.get("staleness", 0.0)))
        if state.version % run.checkpoint_every == 0:
            self.checkpoint(state)
        if self.reached:
            return "target reached"
        if run.max_updates is not None and state.version >= run.max_updates:
            return "update limit"
        return None

    # ---- pieces -----------------------------------------------------------------------------------
    @property
    def session_s(self) -> float:
        """Seconds since this session started."""
        return time.perf_counter() - self.started

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

    def checkpoint(self, state: PPOState) -> None:
        """Save the learner, the loop's counters and this monitor's counters as the checkpoint of the version."""
        if self.last_checkpoint == state.version:
            return
        arrays, learner_values = self.learner.state_dict()
        values = {
            "learner": learner_values,
            "state": dataclasses.asdict(state),
            "episodes": self.episode_count,
            "metric_rows": self.metric_rows,
            "best_mean_return": self.best_mean_return,
            "elapsed_s": self.elapsed_before + self.session_s,
            "curriculum": None,  # the step path has no curriculum; a group run stores its state_dict here
        }
        self.rundir.save_checkpoint(state.version, arrays, values)
        self.last_checkpoint = state.version

    def fraction(self, version: int, with_time: bool = True) -> float:
        """Progress at ``version`` toward the nearest stopping condition (target, update limit and, ``with_time``,
        time limit)."""
        run = self.config.run
        shares = [share(self.session_s, run.max_seconds) if with_time else 0.0]
        if run.target_return is not None:
            shares.append(share(self.best_mean_return, run.target_return))
        if run.max_updates is not None:
            shares.append(share(version, run.max_updates))
        return max(shares)

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
        self.checkpoint(state)
        if self.bar is not None:
            mean = float(np.mean(self.recent)) if self.recent else 0.0
            done = self.reached or reason == "update limit"
            self.bar.close(reason, done, self.fraction(state.version, with_time=False), **self.fields(state, mean, 0.0))
        for tracker in self.trackers:
            tracker.finish()
