"""The fleet report: what a run says about its rollout fleet, built from ``fleet.status()``.

A fleet's ``status()`` lists its workers by slot (each a ``RolloutWorker.info()``: ``worker_id``, ``state``,
``loaded_version``, ``items_sent``, ``dropped_steps``, ``pace_waits``, ``env_restarts``, on the group path
``dropped_groups`` and ``aborted_groups``, and ``pipeline``, the
worker's ``PipelineMonitor.snapshot()``), plus ``restarts`` per slot. :class:`FleetTotals` turns successive
statuses into :class:`FleetReport` values, the wire type a run posts to the buffer server (``POST /fleet``) and
renders on its own metrics port (:mod:`rollhub.observe.fleet_metrics`).

Counters are kept per worker **slot** (``worker = "w0"``, ``"w1"``, ...), not per worker id: a restarted worker
gets a new id (``w0r1``) and starts its own counts from zero, so :class:`FleetTotals` carries the last figures it
saw of the slot's earlier workers into the slot's totals. Every counter of a report is therefore monotonic over
the life of one :class:`FleetTotals` (one run process), which is what ``rate()`` wants; what a worker counted
between the last status read and its death is not seen. The current worker id and state are in the report too.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollhub.errors import RollhubError
from rollhub.observe.run_figures import RunFigures
from rollhub.wire.models import WireFloat, WireInt

MAX_WORKERS = 1024
"""Worker slots one report may carry."""
MAX_PHASES = 16
"""Pipeline phases one worker's figures may carry."""

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
PHASE_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"
Phase = Annotated[str, Field(pattern=PHASE_PATTERN)]
STATE_PATTERN = r"^[a-z_]{1,32}$"
FLEET_PATTERN = r"^[^\x00-\x1f\x7f]+$"
Count = Annotated[WireInt, Field(ge=0)]
Seconds = Annotated[WireFloat, Field(ge=0, allow_inf_nan=False)]

COUNTS: dict[str, tuple[str | None, str]] = {
    "env_steps": ("pipeline", "env_steps"),
    "turns": ("pipeline", "turns"),
    "forward_passes": ("pipeline", "forward_passes"),
    "inference_observations": ("pipeline", "inference_obs"),
    "items_sent": (None, "items_sent"),
    "dropped_steps": (None, "dropped_steps"),
    "pace_waits": (None, "pace_waits"),
    "env_restarts": (None, "env_restarts"),
    "dropped_groups": (None, "dropped_groups"),
    "aborted_groups": (None, "aborted_groups"),
}
"""Each per-worker counter of a report and where it is read in a worker's ``info`` (``pipeline``: its
pipeline snapshot)."""


class FleetStatusError(RollhubError):
    """A fleet status that cannot be read as one (no ``workers`` list)."""


class WorkerFigures(BaseModel):
    """One worker slot in a :class:`FleetReport`: counters since the run started (summed over the slot's
    restarts), the slot's current worker and the weight version it has loaded.

    Attributes:
        worker: the slot's label, stable across restarts (``w0``).
        id: the worker now in the slot (``w0``, then ``w0r1`` after a restart).
        state: its state (``running``, ``waiting_for_weights``, ``dead``, ...).
        weight_version: the weight version it has loaded (``None``: none yet, or it does not answer).
        env_steps, turns, forward_passes, inference_observations: its pipeline's environment steps, turns,
            policy forward passes and the observations they took (mean inference batch = observations /
            forward passes).
        items_sent, dropped_steps, pace_waits, env_restarts: items its writer acknowledged, steps dropped as
            too stale, turns spent waiting for new weights, environment processes restarted.
        dropped_groups, aborted_groups: groups a group worker did not sample because its loaded weights were
            already too stale, and groups left out whole because a completion came back aborted (an engine
            paused for a push, or one that went away mid-generation); 0 on the step path and from reporters
            that predate them.
        restarts: how often the fleet replaced the slot's worker.
        phase_seconds: seconds spent in each pipeline phase (``recv_obs``, ``inference``, ``send_actions``).
    """

    model_config = ConfigDict(extra="forbid")

    worker: Name
    id: Name
    state: Annotated[str, Field(pattern=STATE_PATTERN)]
    weight_version: Count | None = None
    env_steps: Count
    turns: Count
    forward_passes: Count
    inference_observations: Count
    items_sent: Count
    dropped_steps: Count
    pace_waits: Count
    env_restarts: Count
    dropped_groups: Count = 0
    aborted_groups: Count = 0
    restarts: Count
    phase_seconds: Annotated[dict[Phase, Seconds], Field(max_length=MAX_PHASES)]


class FleetReport(BaseModel):
    """``POST /fleet``: one fleet's figures at ``time``; the server keeps the latest per ``fleet``.

    Attributes:
        fleet: the fleet's name (the run's ``run.name``), 1 to 128 printable characters.
        time: when the figures were taken (seconds since the epoch, the sender's clock).
        workers: one entry per worker slot, each ``worker`` label once.
        status_errors: times reading the fleet's status failed (the report then repeats the last figures).
        post_errors: times sending a report to the server failed.
        run: the run's trainer and engine figures (:class:`~rollhub.observe.run_figures.RunFigures`; ``None``
            where the run gives none).
    """

    model_config = ConfigDict(extra="forbid")

    fleet: Annotated[str, Field(min_length=1, max_length=128, pattern=FLEET_PATTERN)]
    time: Annotated[WireFloat, Field(gt=0, allow_inf_nan=False)]
    workers: Annotated[list[WorkerFigures], Field(max_length=MAX_WORKERS)]
    status_errors: Count = 0
    post_errors: Count = 0
    run: RunFigures | None = None

    @field_validator("workers")
    @classmethod
    def _one_entry_per_slot(cls, workers: list[WorkerFigures]) -> list[WorkerFigures]:
        seen: set[str] = set()
        for w in workers:
            if w.worker in seen:
                raise ValueError(f"worker {w.worker!r} appears twice; send one entry per worker slot")
            seen.add(w.worker)
        return workers


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _read(info: Mapping[str, Any], phases: Sequence[str]) -> dict[str, float]:
    """The counters and phase seconds of one worker ``info`` that are there and are numbers >= 0."""
    pipeline = info.get("pipeline")
    pipeline = pipeline if isinstance(pipeline, Mapping) else {}
    out: dict[str, float] = {}
    for name, (part, key) in COUNTS.items():
        value = _number((pipeline if part == "pipeline" else info).get(key))
        if value is not None:
            out[name] = value
    for phase in phases:
        value = _number(pipeline.get(f"{phase}_s"))
        if value is not None:
            out[f"phase:{phase}"] = value
    return out


@dataclass
class _Slot:
    """One slot's totals: ``carried`` from its earlier workers, ``last`` of its current worker ``worker_id``, and
    the fleet's count of its ``restarts``."""

    worker_id: str | None = None
    restarts: int = 0
    carried: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)

    def see(self, worker_id: str, figures: dict[str, float]) -> None:
        fell = any(v < self.last.get(k, 0.0) for k, v in figures.items())
        if self.worker_id is not None and (worker_id != self.worker_id or fell):
            for k, v in self.last.items():  # a new worker (or one that started over): keep what the old one did
                self.carried[k] = self.carried.get(k, 0.0) + v
            self.last = {}
        self.worker_id = worker_id
        self.last.update(figures)

    def total(self, key: str) -> float:
        return self.carried.get(key, 0.0) + self.last.get(key, 0.0)


class FleetTotals:
    """Successive ``fleet.status()`` dicts as :class:`FleetReport` values whose counters never fall.

    Args:
        fleet: the fleet's name in every report.
        phases: the pipeline phases to report (each read as ``<phase>_s`` in a worker's pipeline snapshot).
    """

    def __init__(self, fleet: str, phases: Sequence[str]) -> None:
        bad = [p for p in phases if not re.fullmatch(PHASE_PATTERN, p)]
        if bad:
            raise FleetStatusError(f"phase names {bad} are not lower-case identifiers of up to 32 characters")
        if not re.fullmatch(FLEET_PATTERN, fleet) or len(fleet) > 128:
            raise FleetStatusError(f"fleet name {fleet!r} must be 1 to 128 characters without control characters")
        self.fleet = fleet
        self.phases = tuple(phases)
        self._slots: dict[int, _Slot] = {}

    def update(self, status: Any, now: float, status_errors: int = 0, post_errors: int = 0,
               run: RunFigures | None = None) -> FleetReport:  # fmt: skip
        """The report of ``status`` taken at ``now`` (seconds since the epoch), carrying the run's figures ``run``.

        A worker that does not answer (no ``pipeline`` in its info) keeps its slot's last figures; a field
        that is missing or not a number >= 0 keeps its last value (0 at first).

        Raises:
            FleetStatusError: ``status`` has no ``workers`` list.
        """
        workers = status.get("workers") if isinstance(status, Mapping) else None
        if not isinstance(workers, list):
            raise FleetStatusError(
                f"fleet status has no 'workers' list (got {type(workers).__name__}); pass fleet.status()"
            )
        restarts = status.get("restarts")
        restarts = restarts if isinstance(restarts, list) else []
        figures = []
        for slot, info in enumerate(workers):
            info = info if isinstance(info, Mapping) else {}
            worker_id = info.get("worker_id")
            worker_id = _label(worker_id) if isinstance(worker_id, str) and worker_id else f"w{slot}"
            kept = self._slots.setdefault(slot, _Slot())
            alive = isinstance(info.get("pipeline"), Mapping)
            if alive:
                kept.see(worker_id, _read(info, self.phases))
            figures.append(self._figures(slot, kept, info, alive, restarts, worker_id))
        return FleetReport(
            fleet=self.fleet, time=now, workers=figures, status_errors=status_errors, post_errors=post_errors, run=run
        )

    def _figures(self, slot: int, kept: _Slot, info: Mapping[str, Any], alive: bool, restarts: list[Any],
                 worker_id: str) -> WorkerFigures:  # fmt: skip
        state = info.get("state")
        state = state.lower() if isinstance(state, str) and re.fullmatch(STATE_PATTERN, state.lower()) else "unknown"
        version = info.get("loaded_version") if alive else None
        version = version if isinstance(version, int) and not isinstance(version, bool) and version >= 0 else None
        n_restarts = _number(restarts[slot]) if slot < len(restarts) else None
        kept.restarts = max(kept.restarts, int(n_restarts or 0))  # the fleet's count; held if it goes missing
        return WorkerFigures(
            worker=f"w{slot}",
            id=kept.worker_id or worker_id,
            state=state,
            weight_version=version,
            restarts=kept.restarts,
            phase_seconds={p: kept.total(f"phase:{p}") for p in self.phases},
            **{name: round(kept.total(name)) for name in COUNTS},
        )


_LABEL_CHARS = frozenset(string.ascii_letters + string.digits + "_.:-")


def _label(text: str) -> str:
    """``text`` as a worker label: characters other than letters, digits and ``_.:-`` become ``_``."""
    return "".join(c if c in _LABEL_CHARS else "_" for c in text)[:64]
