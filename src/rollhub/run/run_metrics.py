"""A group run's own figures beside its fleet's: the per-token versions of what the trainer trained on, the
trainer's wait for each batch, what its source left out, and its engines' idle reads.

:class:`RunMetrics` keeps them for the three places that show them: the fleet reports (``FleetReport.run``, so
the run's metrics port and the buffer server's ``/metrics`` and dashboard show the ``rollhub_run_*`` families of
:mod:`rollhub.observe.run_figures`), and the summary (:meth:`RunMetrics.summary`). The trainer's thread fills
it (:class:`VersionTap` around the source, :meth:`RunMetrics.waited` after each update); the reporter's thread
reads it, hence the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from rollhub.experience import Group
from rollhub.experience.versions import VersionTally
from rollhub.inference.engine_idle import IdleCounts
from rollhub.observe.run_figures import SPAN_BOUNDS, WAIT_BOUNDS, BucketCounter, Buckets, EngineReads, RunFigures
from rollhub.run.rundir import Resumed
from rollhub.run.sources import SourceTap
from rollhub.train.grpo import GroupSource


def run_versions(resumed: Resumed | None) -> VersionTally:
    """The version tally a resumed run's checkpoint holds (an empty one for a new run or an older checkpoint)."""
    return VersionTally.from_json(resumed.values.get("token_versions") if resumed is not None else None)


class RunMetrics:
    """The run's figures (see the module docstring).

    Args:
        engines: each engine's idle reads so far (the policy backend's ``engine_reads``).
        versions: the tally to continue (a resumed run's; default: an empty one).
    """

    def __init__(self, engines: Callable[[], Sequence[IdleCounts]],
                 versions: VersionTally | None = None) -> None:  # fmt: skip
        self.engines = engines
        self.versions = versions if versions is not None else VersionTally()
        self.waits = BucketCounter(WAIT_BOUNDS)
        self.stale_groups = 0
        self._lock = threading.Lock()

    def trained(self, groups: Sequence[Group]) -> None:
        """Count a batch the trainer is handed (it trains on every batch served)."""
        with self._lock:
            self.versions.add(groups)

    def waited(self, seconds: float, stale_groups: int) -> None:
        """One update: the trainer waited ``seconds`` for its batch; its source has left ``stale_groups`` out
        so far (over the run)."""
        with self._lock:
            self.waits.observe(seconds)
            self.stale_groups = stale_groups

    def figures(self) -> RunFigures:
        """The fleet report's ``run`` part (the counts so far)."""
        with self._lock:
            tally = self.versions
            span = Buckets.of(SPAN_BOUNDS, tally.spans)
            groups, samples = dict(tally.groups), dict(tally.samples)
            waits, stale = self.waits.buckets(), self.stale_groups
        reads = [EngineReads(engine=str(i), idle=c.idle, busy=c.busy, unanswered=c.unanswered)
                 for i, c in enumerate(self.engines())]  # fmt: skip
        return RunFigures(trained_groups=groups, trained_samples=samples, version_span=span,
                          trainer_wait_seconds=waits, trainer_stale_groups=stale, engines=reads)  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """The summary's ``token_versions`` (:meth:`VersionTally.summary`)."""
        with self._lock:
            return self.versions.summary()


class VersionTap(SourceTap):
    """A :class:`~rollhub.train.grpo.GroupSource` that counts every batch ``source`` serves into ``metrics``
    before handing it on unchanged.

    Args:
        source: the run's source.
        metrics: where the batches are counted.
    """

    def __init__(self, source: GroupSource, metrics: RunMetrics) -> None:
        super().__init__(source)
        self.metrics = metrics

    def saw(self, batch: Sequence[Group]) -> None:
        """Count the batch."""
        self.metrics.trained(batch)
