"""The latest report of each rollout fleet that posts to this server (``POST /fleet``), for ``/metrics`` and the
dashboard. Held in memory only (a restarted server shows a fleet again from its next report), and event-loop side
only (no lock)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from rollhub.observe.fleet_metrics import Received, prometheus_lines, to_json
from rollhub.observe.fleet_report import FleetReport

MAX_FLEETS = 16
"""Fleets held at once; a report from one more fleet forgets the fleet that reported least recently."""


class FleetReports:
    """The latest :class:`FleetReport` per ``fleet`` with the time it arrived (at most ``max_fleets``).

    Args:
        max_fleets: fleets held at once.
        clock: monotonic seconds (a test may move it by hand).
    """

    def __init__(self, max_fleets: int = MAX_FLEETS, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_fleets = max_fleets
        self.clock = clock
        self._latest: OrderedDict[str, tuple[FleetReport, float]] = OrderedDict()

    def put(self, report: FleetReport) -> None:
        """Keep ``report`` as its fleet's latest, forgetting the least recently reported fleet past the bound."""
        self._latest.pop(report.fleet, None)
        self._latest[report.fleet] = (report, self.clock())
        while len(self._latest) > self.max_fleets:
            self._latest.popitem(last=False)

    def received(self) -> list[Received]:
        """Every held report with its age in seconds, by fleet name."""
        now = self.clock()
        return [Received(report, max(0.0, now - at)) for _, (report, at) in sorted(self._latest.items())]

    def lines(self) -> list[str]:
        """The fleet families of ``/metrics`` (none before a fleet reported)."""
        return prometheus_lines(self.received())

    def to_json(self) -> list[dict[str, Any]]:
        """The reports for ``/dashboard/data``, by fleet name, each with ``age_s`` and per-worker ``mean_batch``."""
        return [to_json(r) for r in self.received()]
