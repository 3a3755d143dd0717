"""What the buffer records about the items it serves: how stale they are and how long they waited.

Kept in memory only (not persisted): a restarted server starts its histograms from zero, and items restored from
storage have no arrival time, so they count in the staleness histogram but not in the age one.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from typing import Any

from rollhub.buffer.storage import Entry

STALENESS_BOUNDS: tuple[float, ...] = (0, 1, 2, 3, 4, 6, 8, 16, 32)
AGE_BOUNDS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800, 3600)


class Histogram:
    """Counts per bucket (upper bounds inclusive, as Prometheus' ``le``) plus one bucket past the last bound."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def to_json(self) -> dict[str, Any]:
        """``le`` (the bounds) and ``counts``: NON-cumulative, one per bound and a last one for values above."""
        return {"le": list(self.bounds), "counts": list(self.counts)}

    def lines(self, name: str, help_: str, labels: str = "") -> list[str]:
        """Prometheus text: HELP, TYPE, cumulative ``_bucket`` series, ``_sum`` and ``_count``."""
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        prefix = f"{labels}," if labels else ""
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            le = "+Inf" if bound == math.inf else f"{bound:g}"
            out.append(f'{name}_bucket{{{prefix}le="{le}"}} {running}')
        suffix = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{suffix} {self.sum:.6f}")
        out.append(f"{name}_count{suffix} {running}")
        return out


class ServeObserver:
    """Staleness (in versions) and age (seconds since queued) of every served item.

    The buffer calls :meth:`queued` when an item enters the queue, :meth:`served` once a batch is committed as
    served (after it was encoded and stored), and :meth:`forget` when items leave without being served.
    """

    def __init__(self) -> None:
        self.staleness = Histogram(STALENESS_BOUNDS)
        self.age = Histogram(AGE_BOUNDS)
        self._arrived: dict[int, float] = {}

    def queued(self, entry: Entry, now: float) -> None:
        self._arrived[entry.gid] = now

    def forget(self, gids: Iterable[int]) -> None:
        for gid in gids:
            self._arrived.pop(gid, None)

    def served(self, entries: Iterable[Entry], reference: int, now: float) -> None:
        """Count each item: staleness ``reference - policy_version`` when it has a version; age on first serve.

        ``reference`` is the version the staleness rule compared against when the batch was formed: the latest
        published policy version, or ``current_step`` before any publish (see :mod:`rollhub.buffer.staleness`).
        """
        for e in entries:
            if e.policy_version is not None:
                self.staleness.observe(reference - e.policy_version)
            arrived = self._arrived.pop(e.gid, None)
            if arrived is not None:
                self.age.observe(max(0.0, now - arrived))
