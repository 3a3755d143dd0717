"""The run's own figures: a tap counts every batch the trainer is handed, waits and the source's drops are kept,
and the fleet report's part carries the engines' reads."""

from __future__ import annotations

import numpy as np

from rollhub.experience import Group, Ragged
from rollhub.experience.group import NOT_SAMPLED
from rollhub.experience.versions import VersionTally
from rollhub.inference.engine_idle import IdleCounts
from rollhub.run.run_metrics import RunMetrics, VersionTap


def group(*versions: int | None) -> Group:
    """One sequence per entry: a prompt token, then one completion token sampled by that version (``None``: the
    group has no per-token versions)."""
    tokens = Ragged.from_rows([np.array([1, 2])] * len(versions), np.int32)
    out = Group(tokens=tokens, masks=tokens, scores=np.zeros(len(versions)))
    if None not in versions:
        out.token_versions = Ragged.from_rows([np.array([NOT_SAMPLED, v]) for v in versions], np.int64)
    return out


class ListSource:
    """Serves the given batches in order, then ``None``; records acks and announced versions."""

    def __init__(self, batches: list[list[Group]]) -> None:
        self.batches = batches
        self.stale_groups, self.batches_skipped = 2, 1
        self.acks, self.versions = 0, []

    def next_batch(self, wait_s: float) -> list[Group] | None:
        return self.batches.pop(0) if self.batches else None

    def ack(self) -> None:
        self.acks += 1

    def publish_version(self, version: int) -> None:
        self.versions.append(version)


def test_the_tap_counts_what_is_served_and_passes_everything_through() -> None:
    metrics = RunMetrics(lambda: [IdleCounts(idle=1, busy=3)])
    source = ListSource([[group(2, 2), group(2, 3)], [group(None, None)]])
    tap = VersionTap(source, metrics)
    first = tap.next_batch(1.0)
    assert first is not None and len(first) == 2
    tap.ack()
    tap.publish_version(4)
    assert tap.next_batch(1.0) is not None and tap.next_batch(1.0) is None
    assert (source.acks, source.versions, tap.stale_groups, tap.batches_skipped) == (1, [4], 2, 1)
    assert metrics.versions.groups == {"partial": 1, "whole": 1, "unknown": 1}
    summary = metrics.summary()
    assert summary["groups"]["partial_ratio"] == 0.5 and summary["samples"]["unknown"] == 2


def test_the_figures_carry_the_tally_the_waits_the_drops_and_the_engines() -> None:
    earlier = VersionTally()
    earlier.add([group(0, 2)])  # a resumed run's
    metrics = RunMetrics(lambda: [IdleCounts(idle=1, busy=3), IdleCounts(unanswered=2)], earlier)
    metrics.trained([group(5, 5)])
    metrics.waited(0.3, stale_groups=1)
    metrics.waited(12.0, stale_groups=3)
    figures = metrics.figures()
    assert figures.trained_groups == {"partial": 1, "whole": 1, "unknown": 0}
    assert figures.version_span.counts[:3] == [1, 0, 1]  # spans 0 and 2
    assert figures.trainer_wait_seconds.count == 2 and figures.trainer_stale_groups == 3
    assert [(e.engine, e.idle, e.busy, e.unanswered) for e in figures.engines] == [("0", 1, 3, 0), ("1", 0, 0, 2)]
