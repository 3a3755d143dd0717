"""Prometheus text exposition without a client library: counters, gauges and latency histograms."""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from typing import Any

from rollhub.buffer import ExperienceBuffer
from rollhub.server.budget import RequestBudget

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistograms:
    """Request latency per (method, route) with Prometheus' cumulative buckets."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0] * (len(_BUCKETS) + 1))
        self._sums: dict[tuple[str, str], float] = defaultdict(float)
        self.status: dict[tuple[str, str, int], int] = defaultdict(int)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route)
        self._counts[key][bisect.bisect_left(_BUCKETS, seconds)] += 1
        self._sums[key] += seconds
        self.status[(method, route, status)] += 1

    def lines(self) -> list[str]:
        out = ["# TYPE rollhub_request_seconds histogram"]
        for (method, route), counts in sorted(self._counts.items()):
            labels = f'method="{method}",route="{route}"'
            running = 0
            for bound, n in zip((*_BUCKETS, float("inf")), counts, strict=True):
                running += n
                le = "+Inf" if bound == float("inf") else repr(bound)
                out.append(f'rollhub_request_seconds_bucket{{{labels},le="{le}"}} {running}')
            out.append(f"rollhub_request_seconds_sum{{{labels}}} {self._sums[(method, route)]:.6f}")
            out.append(f"rollhub_request_seconds_count{{{labels}}} {running}")
        out.append("# TYPE rollhub_requests_total counter")
        for (method, route, status), n in sorted(self.status.items()):
            out.append(f'rollhub_requests_total{{method="{method}",route="{route}",status="{status}"}} {n}')
        return out


def render(buffer: ExperienceBuffer, latency: LatencyHistograms, budget: RequestBudget | None = None) -> str:
    """All metrics as Prometheus text format 0.0.4 (with the request memory budget's when given)."""
    c = buffer.counters
    status = buffer.status()
    lines: list[str] = []

    def metric(name: str, kind: str, value: Any, help_: str) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"])

    metric("rollhub_groups_in_total", "counter", c.groups_in, "Groups accepted.")
    metric("rollhub_sequences_in_total", "counter", c.sequences_in, "Sequences accepted.")
    metric("rollhub_tokens_in_total", "counter", c.tokens_in, "Tokens accepted.")
    metric("rollhub_batches_out_total", "counter", c.batches_out, "Batches served (redeliveries included).")
    metric("rollhub_sequences_out_total", "counter", c.sequences_out, "Sequences served.")
    metric("rollhub_redelivered_total", "counter", c.redelivered, "Leased batches served again after expiry.")
    metric("rollhub_refused_full_total", "counter", c.refused_full, "Requests refused with 429 (queue full).")
    metric("rollhub_current_step", "gauge", status["current_step"], "Trainer step (batches served).")
    metric("rollhub_queue_groups", "gauge", status["queue_size"], "Groups waiting in the queue.")
    metric("rollhub_queue_sequences", "gauge", status["queued_sequences"], "Sequences waiting in the queue.")
    metric("rollhub_held_sequences", "gauge", status["held_sequences"], "Sequences held for group combining.")
    metric("rollhub_leased_batches", "gauge", status["leased_batches"], "Batches leased and not yet acked.")
    by_env: dict[str, int] = defaultdict(int)
    for e in buffer.queued():
        by_env[str(e.env_id)] += e.size
    lines.append("# TYPE rollhub_queue_sequences_by_env gauge")
    lines.extend(f'rollhub_queue_sequences_by_env{{env_id="{k}"}} {v}' for k, v in sorted(by_env.items()))
    lines.append("# TYPE rollhub_stale_dropped_total counter")
    lines.extend(f'rollhub_stale_dropped_total{{env_id="{k}"}} {v}' for k, v in sorted(status["stale_dropped"].items()))
    lines.extend(latency.lines())
    if budget is not None:
        lines.extend(budget.lines())
    return "\n".join(lines) + "\n"


class TimingMiddleware:
    """Pure-ASGI request timing into :class:`LatencyHistograms` (unknown paths are counted as ``other``)."""

    def __init__(self, app: Any, latency: LatencyHistograms, routes: set[str]) -> None:
        self.app = app
        self.latency = latency
        self.routes = routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def wrapped(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, wrapped)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.latency.observe(scope["method"], route, status, time.perf_counter() - start)
