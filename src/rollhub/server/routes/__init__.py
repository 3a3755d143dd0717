"""The HTTP routes, one ``APIRouter`` per area, each built around the server's shared parts (:class:`Hub`).

* :mod:`.atropos`: AtroposLib 0.4.0's 13 routes, byte-compatible for JSON clients (plus msgpack bodies,
  long-poll and leases on ``GET /batch``, ``?env_id=`` on ``/status-env``);
* :mod:`.extensions`: rollhub's own routes (``/health``, ``/ack``, ``/policy-version``, ``/fleet``);
* :mod:`.observability`: ``/metrics`` and the dashboard;
* :mod:`rollhub.server.docs`: the offline API documentation.

Every buffer call that may touch storage (or wait on the buffer's lock) runs on :attr:`Hub.thread`, so a slow
commit never stalls the event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rollhub.buffer import ExperienceBuffer
from rollhub.server.budget import RequestBudget
from rollhub.server.fleets import FleetReports
from rollhub.server.heap import HeapTrimmer
from rollhub.server.ingest import Ingest
from rollhub.server.metrics import LatencyHistograms
from rollhub.server.settings import ServerSettings
from rollhub.server.worker import StorageThread


class Arrivals:
    """Wakes long-polling ``GET /batch`` requests when data arrives (event-loop side only)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def notify(self) -> None:
        self.event.set()
        self.event = asyncio.Event()


@dataclass
class Hub:
    """What the routes share: the buffer, the thread its calls run on, and the server's own state.

    Attributes:
        buffer: the experience buffer every route serves.
        settings: the server's settings.
        thread: where blocking buffer calls run.
        ingest: the one ingest (also used by the binary fast path).
        arrivals: wakes long-polls; notified by ``ingest``.
        latency: request latency per route (``/metrics``).
        budget: the request memory budget (``/metrics``).
        trim_heap: gives freed request memory back to the system after general-path ingests.
        fleets: the latest report of each rollout fleet (``POST /fleet``; ``/metrics`` and the dashboard).
    """

    buffer: ExperienceBuffer
    settings: ServerSettings
    thread: StorageThread
    ingest: Ingest
    arrivals: Arrivals
    budget: RequestBudget
    latency: LatencyHistograms = field(default_factory=LatencyHistograms)
    trim_heap: HeapTrimmer = field(default_factory=HeapTrimmer)
    fleets: FleetReports = field(default_factory=FleetReports)
