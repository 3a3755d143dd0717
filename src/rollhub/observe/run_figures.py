"""What a group run says about its trainer and its engines, beside its fleet's figures: the wire type a fleet
report carries (:class:`RunFigures`, ``FleetReport.run``), the histograms that fill it, and its Prometheus text.

Series (every one with ``fleet``, the run's name; counts since the run process started, the version counts since
the run started, earlier sessions of a resumed run included):

* ``rollhub_run_trained_groups_total{versions}``, ``rollhub_run_trained_samples_total{versions}``: groups and
  samples the trainer trained on, by what their per-token versions say (:mod:`rollhub.experience.versions`):
  ``partial`` (sampled by more than one weight version), ``whole`` (one), ``unknown`` (no per-token versions,
  as on the completions route); ``rollhub_run_partial_groups_ratio`` and ``rollhub_run_partial_samples_ratio``:
  partial over partial + whole (absent while nothing is known);
* ``rollhub_run_group_version_span``: a histogram of each trained group's newest minus oldest token version
  (known groups only);
* ``rollhub_run_trainer_wait_seconds``: a histogram of the seconds the trainer waited for the batch of each
  update (``wait_s`` of ``metrics.jsonl``);
* ``rollhub_run_trainer_stale_groups_total``: groups the trainer's source left out as too stale (0 where the
  buffer server guards the bound; its own drops are ``rollhub_stale_dropped_total`` on the server);
* ``rollhub_run_engine_reads_total{engine,state}``, ``rollhub_run_engine_idle_fraction{engine}``: the reads of
  each engine's running requests (:mod:`rollhub.inference.engine_idle`) that found it ``idle``, ``busy`` or
  ``unanswered``, and idle over answered reads (absent before one answered).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollhub.observe.prometheus import escape_label
from rollhub.wire.models import WireFloat, WireInt

PREFIX = "rollhub_run_"
SPAN_BOUNDS: tuple[float, ...] = (0, 1, 2, 3, 4, 8)
"""Upper bounds (inclusive) of the version-span histogram's buckets."""
WAIT_BOUNDS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
"""Upper bounds (inclusive, seconds) of the trainer-wait histogram's buckets."""
MAX_BUCKETS = 32
MAX_ENGINES = 1024

Count = Annotated[WireInt, Field(ge=0)]
Kind = Literal["partial", "whole", "unknown"]


class Buckets(BaseModel):
    """A histogram: ``le`` (ascending upper bounds, inclusive), ``counts`` (per bucket, NOT cumulative, one more
    than ``le``: the last for values above the last bound) and ``sum`` of the values."""

    model_config = ConfigDict(extra="forbid")

    le: Annotated[list[Annotated[WireFloat, Field(allow_inf_nan=False)]], Field(max_length=MAX_BUCKETS)]
    counts: Annotated[list[Count], Field(max_length=MAX_BUCKETS + 1)]
    sum: Annotated[WireFloat, Field(ge=0, allow_inf_nan=False)] = 0.0

    @model_validator(mode="after")
    def _shape(self) -> Buckets:
        if len(self.counts) != len(self.le) + 1:
            raise ValueError(f"counts has {len(self.counts)} values for {len(self.le)} bounds; send len(le) + 1")
        if any(b >= a for a, b in zip(self.le[1:], self.le, strict=False)):
            raise ValueError("le must be strictly ascending")
        return self

    @classmethod
    def of(cls, bounds: Sequence[float], values: Mapping[float, int]) -> Buckets:
        """The buckets of ``values`` (each value with how often it was seen)."""
        counts = [0] * (len(bounds) + 1)
        for value, n in values.items():
            counts[bisect.bisect_left(bounds, value)] += n
        return cls(le=list(bounds), counts=counts, sum=float(sum(v * n for v, n in values.items())))

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self, name: str, help_: str, labels: str) -> list[str]:
        """Prometheus text: HELP, TYPE, cumulative ``_bucket`` series, ``_sum`` and ``_count``."""
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip((*self.le, math.inf), self.counts, strict=True):
            running += n
            le = "+Inf" if bound == math.inf else f"{bound:g}"
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
        out += [f"{name}_sum{{{labels}}} {self.sum:.6f}", f"{name}_count{{{labels}}} {running}"]
        return out


class BucketCounter:
    """A histogram filled one value at a time in this process; :meth:`buckets` gives its wire form."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += max(0.0, value)

    def buckets(self) -> Buckets:
        return Buckets(le=list(self.bounds), counts=list(self.counts), sum=self.sum)


class EngineReads(BaseModel):
    """One engine's reads of its running requests: ``idle`` (none running), ``busy``, ``unanswered``."""

    model_config = ConfigDict(extra="forbid")

    engine: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
    idle: Count = 0
    busy: Count = 0
    unanswered: Count = 0

    @property
    def idle_fraction(self) -> float | None:
        answered = self.idle + self.busy
        return self.idle / answered if answered else None


class RunFigures(BaseModel):
    """A group run's trainer and engine figures in a fleet report (see the module docstring).

    Attributes:
        trained_groups, trained_samples: groups and samples trained on, per kind of their per-token versions.
        version_span: trained groups by their version span (known groups only).
        trainer_wait_seconds: updates by the seconds the trainer waited for their batch.
        trainer_stale_groups: groups the trainer's source left out as too stale.
        engines: each engine's reads (none on a backend without engines).
    """

    model_config = ConfigDict(extra="forbid")

    trained_groups: dict[Kind, Count]
    trained_samples: dict[Kind, Count]
    version_span: Buckets
    trainer_wait_seconds: Buckets
    trainer_stale_groups: Count = 0
    engines: Annotated[list[EngineReads], Field(max_length=MAX_ENGINES)] = []


def partial_ratio(counts: Mapping[str, int]) -> float | None:
    """Partial over partial + whole in ``counts`` (the unknown left out); ``None`` when nothing is known."""
    known = counts.get("partial", 0) + counts.get("whole", 0)
    return counts.get("partial", 0) / known if known else None


def _value(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(round(float(value), 6))


def prometheus_lines(fleet: str, figures: RunFigures) -> list[str]:
    """The ``rollhub_run_*`` families of one run's ``figures`` (see the module docstring)."""
    run = f'fleet="{escape_label(fleet)}"'
    out: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        out.extend([f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} {kind}"])
        out.extend(f"{PREFIX}{name}{{{labels}}} {_value(v)}" for labels, v in samples)

    for what, counts in (("groups", figures.trained_groups), ("samples", figures.trained_samples)):
        family(
            f"trained_{what}_total", "counter",
            f"Trained {what} by their per-token versions: partial (more than one weight version), whole (one), "
            "unknown (no per-token versions).",
            [(f'{run},versions="{k}"', counts.get(k, 0)) for k in ("partial", "whole", "unknown")],
        )  # fmt: skip
        ratio = partial_ratio(counts)
        family(
            f"partial_{what}_ratio", "gauge",
            f"Partial trained {what} over partial + whole ones (unknown ones left out).",
            [] if ratio is None else [(run, ratio)],
        )  # fmt: skip
    out += figures.version_span.lines(
        PREFIX + "group_version_span",
        "Trained groups by their newest minus oldest token version (groups with per-token versions only).",
        run,
    )
    out += figures.trainer_wait_seconds.lines(
        PREFIX + "trainer_wait_seconds", "Seconds the trainer waited for the batch of each update.", run
    )
    family("trainer_stale_groups_total", "counter", "Groups the trainer's source left out as too stale.",
           [(run, figures.trainer_stale_groups)])  # fmt: skip
    reads = [
        (f'{run},engine="{escape_label(e.engine)}",state="{state}"', getattr(e, state))
        for e in figures.engines
        for state in ("idle", "busy", "unanswered")
    ]
    family("engine_reads_total", "counter",
           "Reads of an engine's running requests that found none (idle), some (busy), or no answer.",
           reads)  # fmt: skip
    fractions = [(f'{run},engine="{escape_label(e.engine)}"', e.idle_fraction) for e in figures.engines]
    family("engine_idle_fraction", "gauge", "Idle reads over answered reads of an engine since the run started.",
           [(labels, f) for labels, f in fractions if f is not None])  # fmt: skip
    return out


def wait_summary(waits: Sequence[float]) -> dict[str, Any]:
    """The run summary's view of the trainer's waits per update: ``median``, ``p95`` (nearest rank), ``max`` and
    the number of ``updates`` (``None`` figures without any)."""
    if not waits:
        return {"median": None, "p95": None, "max": None, "updates": 0}
    ordered = sorted(waits)
    p95 = ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]
    return {
        "median": round(statistics.median(ordered), 4),
        "p95": round(p95, 4),
        "max": round(ordered[-1], 4),
        "updates": len(ordered),
    }
