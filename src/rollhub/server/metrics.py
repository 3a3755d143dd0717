"""Prometheus text exposition without a client library: counters, gauges and latency histograms."""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from typing import Any

from rollhub.buffer import ExperienceBuffer
from rollhub.observe.prometheus import escape_label
from rollhub.server import shapes
from rollhub.server.budget import RequestBudget

NO_ENV = "(no env)"

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
        out = [
            "# HELP rollhub_request_seconds Time to answer an HTTP request, per method and route.",
            "# TYPE rollhub_request_seconds histogram",
        ]
        for (method, route), counts in sorted(self._counts.items()):
            labels = f'method="{method}",route="{route}"'
            running = 0
            for bound, n in zip((*_BUCKETS, float("inf")), counts, strict=True):
                running += n
                le = "+Inf" if bound == float("inf") else repr(bound)
                out.append(f'rollhub_request_seconds_bucket{{{labels},le="{le}"}} {running}')
            out.append(f"rollhub_request_seconds_sum{{{labels}}} {self._sums[(method, route)]:.6f}")
            out.append(f"rollhub_request_seconds_count{{{labels}}} {running}")
        out.append("# HELP rollhub_requests_total HTTP requests answered, per method, route and status.")
        out.append("# TYPE rollhub_requests_total counter")
        for (method, route, status), n in sorted(self.status.items()):
            out.append(f'rollhub_requests_total{{method="{method}",route="{route}",status="{status}"}} {n}')
        return out


def render(buffer: ExperienceBuffer, latency: LatencyHistograms, budget: RequestBudget | None = None) -> str:
    """All metrics as Prometheus text format 0.0.4 (with the request memory budget's when given)."""
    return server_text(buffer_lines(buffer), latency, budget)


def server_text(buffer_part: list[str], latency: LatencyHistograms, budget: RequestBudget | None = None) -> str:
    """The buffer's lines (:func:`buffer_lines`, taken on the storage thread) with the request figures, which
    the event loop updates and so must read."""
    lines = [*buffer_part, *latency.lines()]
    if budget is not None:
        lines.extend(budget.lines())
    return "\n".join(lines) + "\n"


def buffer_lines(buffer: ExperienceBuffer) -> list[str]:
    """The buffer's metrics in Prometheus text format (call it where buffer calls run: it takes the lock)."""
    c = buffer.counters
    status = shapes.status(buffer.status())
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
    metric("rollhub_lease_expiries_total", "counter", c.lease_expiries, "Leased batches whose lease ran out unacked.")
    metric("rollhub_serve_failures_total", "counter", c.serve_failures, "Batches formed but not served (put back).")
    lines.extend(_per_env_lines(buffer, status["stale_dropped"]))
    lines.extend(buffer.observed.staleness.lines("rollhub_served_staleness_versions", STALENESS_HELP))
    lines.extend(buffer.observed.age.lines("rollhub_served_item_age_seconds", AGE_HELP))
    return lines


STALENESS_HELP = (
    "Served items (groups) by current_step - policy_version, the lag the max_staleness rule checks, counted when "
    "the batch is committed as served; a lease redelivered after expiry is counted again; items without a "
    "policy_version are not counted."
)
AGE_HELP = (
    "Seconds from entering the queue (a combined group: from being completed) to first being served; "
    "items restored from storage after a restart are not counted."
)


def env_names(buffer: ExperienceBuffer) -> dict[int | None, str]:
    """Each env_id's registered ``desired_name``; ``None`` (groups without an env_id) is ``(no env)``."""
    names: dict[int | None, str] = {env.env_id: env.desired_name for env in list(buffer.envs)}
    names[None] = NO_ENV
    return names


def name_of(names: dict[int | None, str], env_id: int | None) -> str:
    return names.get(env_id, f"env {env_id}")


def by_name(names: dict[int | None, str], per_id: dict[int | None, list[int]], column: int) -> dict[str, int]:
    """Per-env_id counter rows summed per registered name (every registered name present, zero if idle)."""
    out = {name: 0 for env_id, name in names.items() if env_id is not None}
    for env_id, row in list(per_id.items()):
        key = name_of(names, env_id)
        out[key] = out.get(key, 0) + row[column]
    return out


def queued_by_env(buffer: ExperienceBuffer) -> dict[int | None, list[int]]:
    """``[groups, sequences]`` waiting in the queue, per env_id (only envs with something queued)."""
    return {env_id: list(row) for env_id, row in buffer.queued_by_env().items()}


def _per_env_lines(buffer: ExperienceBuffer, stale: dict[str, int]) -> list[str]:
    c = buffer.counters
    names = env_names(buffer)
    lines: list[str] = []
    counted = (
        ("rollhub_ingested_groups_total", c.ingested_by_env, 0, "Groups (or items) accepted, per env name."),
        ("rollhub_ingested_sequences_total", c.ingested_by_env, 1, "Sequences accepted, per env name."),
        ("rollhub_served_groups_total", c.served_by_env, 0, "Groups served, per env name (redeliveries included)."),
        ("rollhub_served_sequences_total", c.served_by_env, 1, "Sequences served, per env name (redeliveries too)."),
    )
    for name, per_id, column, help_ in counted:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} counter"])
        rows = sorted(by_name(names, per_id, column).items())
        lines.extend(f'{name}{{env="{escape_label(k)}"}} {v}' for k, v in rows)
    queued = {env_id: [0, 0] for env_id in names if env_id is not None} | queued_by_env(buffer)
    gauges = (
        ("rollhub_queue_groups_by_env", 0, "Groups waiting in the queue, per env."),
        ("rollhub_queue_sequences_by_env", 1, "Sequences waiting in the queue, per env."),
    )
    for name, column, help_ in gauges:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} gauge"])
        for env_id, row in sorted(queued.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            lines.append(f'{name}{{env_id="{env_id}",env="{escape_label(name_of(names, env_id))}"}} {row[column]}')
    name = "rollhub_stale_dropped_total"
    lines.extend(
        [f"# HELP {name} Queued items dropped as too stale (max_staleness), per env.", f"# TYPE {name} counter"]
    )
    for key, n in sorted(stale.items()):
        env_id = int(key) if key.isdigit() else None
        lines.append(f'{name}{{env_id="{key}",env="{escape_label(name_of(names, env_id))}"}} {n}')
    return lines


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
