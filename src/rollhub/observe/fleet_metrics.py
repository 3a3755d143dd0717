"""Fleet reports (:class:`rollhub.observe.fleet_report.FleetReport`) as Prometheus text and as the dashboard's JSON.

Every series carries ``fleet`` (the run's name) and, per worker, ``worker`` (the slot, ``w0``: stable across
restarts, see :mod:`rollhub.observe.fleet_report`). Counters count since the run started:

* ``rollhub_fleet_env_steps_total``, ``rollhub_fleet_turns_total``: environment steps and pipeline turns;
* ``rollhub_fleet_forward_passes_total``, ``rollhub_fleet_inference_observations_total``: policy forward passes
  and the observations they took (mean inference batch: the ratio of their rates);
* ``rollhub_fleet_phase_seconds_total{phase}``: seconds per pipeline phase;
* ``rollhub_fleet_items_sent_total``, ``rollhub_fleet_dropped_steps_total``, ``rollhub_fleet_pace_waits_total``;
* ``rollhub_fleet_dropped_groups_total``, ``rollhub_fleet_aborted_groups_total``: groups a group worker did not
  sample (its weights already too stale) and groups left out whole for an aborted completion;
* ``rollhub_fleet_env_restarts_total``, ``rollhub_fleet_worker_restarts_total``: environment processes
  restarted, and workers the fleet replaced, per slot;
* ``rollhub_fleet_reporter_errors_total{kind}``: status reads (``status``) and report posts (``post``) that
  failed.

Gauges: ``rollhub_fleet_worker_weight_version`` (per worker, absent until it loaded one),
``rollhub_fleet_worker_info{id,state}`` (1 for the worker now in each slot), ``rollhub_fleet_workers{state}``,
and on the buffer server ``rollhub_fleet_report_age_seconds`` (time since the fleet's last report arrived).

A report that carries the run's own figures (``run``) adds the ``rollhub_run_*`` families of
:mod:`rollhub.observe.run_figures`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollhub.observe.fleet_report import FleetReport, WorkerFigures
from rollhub.observe.prometheus import escape_label
from rollhub.observe.run_figures import partial_ratio
from rollhub.observe.run_figures import prometheus_lines as run_lines

PREFIX = "rollhub_fleet_"

WORKER_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("env_steps_total", "env_steps", "Environment steps taken, per worker slot."),
    ("turns_total", "turns", "Pipeline turns (observations in, forward pass, actions out), per worker slot."),
    ("forward_passes_total", "forward_passes", "Policy forward passes (inference batches), per worker slot."),
    (
        "inference_observations_total",
        "inference_observations",
        "Observations over all forward passes, per worker slot; over forward passes: the mean inference batch.",
    ),
    ("items_sent_total", "items_sent", "Items (fragments or groups) the writer acknowledged, per worker slot."),
    ("dropped_steps_total", "dropped_steps", "Steps dropped as too stale before sending, per worker slot."),
    ("pace_waits_total", "pace_waits", "Turns spent waiting for new weights (pacing), per worker slot."),
    ("env_restarts_total", "env_restarts", "Environment processes restarted, per worker slot."),
    ("dropped_groups_total", "dropped_groups", "Groups not sampled on too stale weights, per worker slot."),
    ("aborted_groups_total", "aborted_groups", "Groups left out for an aborted completion, per worker slot."),
    ("worker_restarts_total", "restarts", "Workers the fleet replaced (died or failed), per worker slot."),
)
"""``(name after the prefix, WorkerFigures field, help)`` of each per-worker counter."""


@dataclass(frozen=True)
class Received:
    """A report as the buffer server holds it: ``age_s`` since it arrived (``None`` where it is live)."""

    report: FleetReport
    age_s: float | None = None


def _value(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(round(float(value), 6))


def _labels(**labels: object) -> str:
    return ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())


class _Page:
    """Prometheus text families, each with its HELP and TYPE lines before its samples."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        self.lines += [f"{name}{{{labels}}} {_value(v)}" for labels, v in samples]


def prometheus_lines(reports: Sequence[Received]) -> list[str]:
    """The families above for ``reports`` (fleets by name, workers in report order); none without reports."""
    if not reports:
        return []
    page = _Page()
    ordered = sorted(reports, key=lambda r: r.report.fleet)
    slots = [(r.report.fleet, w) for r in ordered for w in r.report.workers]

    def per_worker(pick: Any) -> list[tuple[str, float]]:
        return [(_labels(fleet=f, worker=w.worker), pick(w)) for f, w in slots if pick(w) is not None]

    for name, field, help_ in WORKER_COUNTERS:
        page.family(PREFIX + name, "counter", help_, per_worker(lambda w, field=field: getattr(w, field)))
    phases = [
        (_labels(fleet=f, worker=w.worker, phase=p), s) for f, w in slots for p, s in sorted(w.phase_seconds.items())
    ]
    page.family(PREFIX + "phase_seconds_total", "counter", "Seconds spent per pipeline phase, per worker.", phases)
    page.family(
        PREFIX + "worker_weight_version",
        "gauge",
        "Weight version the worker has loaded (absent until it loaded one).",
        per_worker(lambda w: w.weight_version),
    )
    info = [(_labels(fleet=f, worker=w.worker, id=w.id, state=w.state), 1) for f, w in slots]
    page.family(PREFIX + "worker_info", "gauge", "The worker now in each slot (id) and its state: always 1.", info)
    page.family(PREFIX + "workers", "gauge", "Worker slots per state.", _by_state(ordered))
    errors = [
        (_labels(fleet=r.report.fleet, kind=kind), n)
        for r in ordered
        for kind, n in (("status", r.report.status_errors), ("post", r.report.post_errors))
    ]
    page.family(PREFIX + "reporter_errors_total", "counter", "Fleet status reads and report posts that failed.", errors)
    ages = [(_labels(fleet=r.report.fleet), r.age_s) for r in ordered if r.age_s is not None]
    if ages:
        page.family(PREFIX + "report_age_seconds", "gauge", "Seconds since the fleet's last report arrived.", ages)
    for r in ordered:
        if r.report.run is not None:
            page.lines += run_lines(r.report.fleet, r.report.run)
    return page.lines


def _by_state(reports: Sequence[Received]) -> list[tuple[str, float]]:
    out = []
    for r in reports:
        states: dict[str, int] = {}
        for w in r.report.workers:
            states[w.state] = states.get(w.state, 0) + 1
        out += [(_labels(fleet=r.report.fleet, state=s), n) for s, n in sorted(states.items())]
    return out


def mean_batch(worker: WorkerFigures) -> float | None:
    """Observations per forward pass since the run started (``None`` before the first pass)."""
    return worker.inference_observations / worker.forward_passes if worker.forward_passes else None


def to_json(received: Received) -> dict[str, Any]:
    """A report for ``/dashboard/data``: the report's fields, ``age_s``, each worker's ``mean_batch`` and, with
    the run's figures, their ``partial_groups_ratio``, ``partial_samples_ratio`` and each engine's
    ``idle_fraction`` (``None`` where nothing is known)."""
    out = received.report.model_dump()
    out["age_s"] = received.age_s
    for row, worker in zip(out["workers"], received.report.workers, strict=True):
        row["mean_batch"] = mean_batch(worker)
    run = received.report.run
    if run is not None:
        out["run"]["partial_groups_ratio"] = partial_ratio(run.trained_groups)
        out["run"]["partial_samples_ratio"] = partial_ratio(run.trained_samples)
        for row, engine in zip(out["run"]["engines"], run.engines, strict=True):
            row["idle_fraction"] = engine.idle_fraction
    return out
