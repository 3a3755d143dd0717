"""Rollout statistics: `EpisodeStatistics` (episode outcomes per task) and `PipelineMonitor` (stage timings).

Both are plain classes; the Ray fleet runs one :class:`EpisodeStatistics` as a Ray actor that every worker
reports to (through :class:`rollhub.rollout.backends.ray.RemoteStatistics`), the local fleet shares one
:class:`SharedStatistics` among its worker threads, and every worker keeps its own :class:`PipelineMonitor`.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from rollhub.errors import ConfigError
from rollhub.rollout.protocols import EpisodeResult

STAGES = ("recv_obs", "inference", "send_actions")
"""The pipeline stages a step manager reports, in order."""


@dataclass(frozen=True)
class EpisodeRecord(EpisodeResult):
    """One episode as stored by :class:`EpisodeStatistics`: its result, then its ``index`` (counting all
    episodes, from 0), the worker that reported it and when (``time.time()``)."""

    index: int
    worker_id: str
    time: float


_RESULT_FIELDS = tuple(f.name for f in fields(EpisodeResult))


class EpisodeStatistics:
    """Episode outcomes per task: return, discounted return, length and count.

    Keeps the newest episodes' summaries in order (a few numbers each, at least ``keep`` of them and at most
    twice that), so the trainer can read them as they come (``history(start)``) and draw a learning curve,
    without the fleet's memory growing with every episode of a long run; the counts cover all episodes, and a
    window of the latest ``window`` episodes per task gives the running means.
    """

    def __init__(self, window: int = 100, keep: int = 100_000) -> None:
        if keep < 1:
            raise ConfigError(f"EpisodeStatistics keep must be >= 1 episode, got {keep}")
        self.window = window
        self.keep = keep
        self._episodes: list[EpisodeRecord] = []
        self._first = 0  # the index of _episodes[0]
        self._count: dict[str, int] = defaultdict(int)
        self._recent: dict[str, deque[EpisodeRecord]] = defaultdict(lambda: deque(maxlen=window))

    @property
    def total(self) -> int:
        """Episodes recorded so far, all of them."""
        return self._first + len(self._episodes)

    def record(self, episodes: list[EpisodeResult], worker_id: str = "") -> int:
        """Add finished episodes; return the total number of episodes recorded."""
        now = time.time()
        for ep in episodes:
            rec = EpisodeRecord(
                **{name: getattr(ep, name) for name in _RESULT_FIELDS}, index=self.total, worker_id=worker_id, time=now
            )
            self._episodes.append(rec)
            self._count[ep.task] += 1
            self._recent[ep.task].append(rec)
        if len(self._episodes) > 2 * self.keep:  # forget the oldest, a block at a time
            drop = len(self._episodes) - self.keep
            del self._episodes[:drop]
            self._first += drop
        return self.total

    def history(self, start: int = 0) -> list[EpisodeRecord]:
        """Kept episodes with ``index >= start``, in the order they were recorded (when ``start`` is older than
        the oldest kept, the first one's ``index`` is greater than ``start``)."""
        return self._episodes[max(start - self._first, 0) :]

    def recent_returns(self, n: int, task: str | None = None) -> list[float]:
        """Returns of the last ``n`` episodes (of ``task``, or of all tasks)."""
        eps = self._episodes if task is None else [e for e in self._recent[task]]
        return [e.ret for e in eps[-n:]]

    def summary(self) -> dict[str, dict[str, float]]:
        """Per task: ``count`` (all time) and the means over the last ``window`` episodes."""
        out: dict[str, dict[str, float]] = {}
        for task, recent in self._recent.items():
            out[task] = {
                "count": float(self._count[task]),
                "mean_return": float(np.mean([e.ret for e in recent])),
                "mean_discounted_return": float(np.mean([e.discounted_return for e in recent])),
                "mean_length": float(np.mean([e.length for e in recent])),
            }
        return out


def fleet_status(infos: list[dict[str, Any]], restarts: list[int], events: list[str]) -> dict[str, Any]:
    """A fleet's status from its workers' ``info``: the infos, the pipeline figures summed over them
    (``env_steps``, ``turns``, ``forward_passes``, ``inference_obs`` and seconds per stage), restarts per slot
    and the last 50 events."""
    pipeline: dict[str, float] = {}
    for info in infos:
        for key in ("env_steps", "turns", "forward_passes", "inference_obs", *(f"{stage}_s" for stage in STAGES)):
            pipeline[key] = pipeline.get(key, 0.0) + info.get("pipeline", {}).get(key, 0.0)
    return {"workers": infos, "pipeline": pipeline, "restarts": list(restarts), "events": list(events[-50:])}


class SharedStatistics:
    """One :class:`EpisodeStatistics` shared by the threads of one process (the local fleet's workers and the
    trainer's monitor): ``record`` and ``history`` under a lock, as the Ray fleet's ``RemoteStatistics`` offers
    them across processes."""

    def __init__(self, window: int = 100) -> None:
        self._lock = threading.Lock()
        self.episodes = EpisodeStatistics(window)

    def record(self, episodes: list[EpisodeResult], worker_id: str = "") -> int:
        """Add finished episodes; return the total number recorded."""
        with self._lock:
            return self.episodes.record(episodes, worker_id)

    def history(self, start: int = 0) -> list[EpisodeRecord]:
        """Episodes with ``index >= start``, in the order they were recorded."""
        with self._lock:
            return self.episodes.history(start)


class PipelineMonitor:
    """Accumulated time per pipeline stage, environment steps and inference batch sizes, for finding the
    bottleneck."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.calls = 0
        self.env_steps = 0
        self.forward_passes = 0
        self.batched = 0  # observations over all forward passes
        self.started = time.perf_counter()

    def add(self, timings: dict[str, float], env_steps: int, inference_batch: int = 0, passes: int = 1) -> None:
        """Add the timings of one pipeline turn, the steps it took, the observations of its forward passes and
        how many passes they were."""
        for stage, seconds in timings.items():
            self.totals[stage] = self.totals.get(stage, 0.0) + seconds
        self.calls += 1
        self.env_steps += env_steps
        if inference_batch:
            self.forward_passes += passes
            self.batched += inference_batch

    def snapshot(self) -> dict[str, float]:
        """Total seconds and mean milliseconds per turn for every stage, steps and steps/s, forward passes and
        their mean batch (observations per forward pass)."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        out: dict[str, float] = {"turns": float(self.calls), "env_steps": float(self.env_steps)}
        for stage, total in self.totals.items():
            out[f"{stage}_s"] = total
            out[f"{stage}_ms_per_turn"] = 1000.0 * total / max(self.calls, 1)
        out["steps_per_s"] = self.env_steps / elapsed
        out["forward_passes"] = float(self.forward_passes)
        out["inference_obs"] = float(self.batched)
        out["mean_inference_batch"] = self.batched / max(self.forward_passes, 1)
        return out
