"""Where a trainer's batches of fragments come from: the :class:`FragmentSource` protocol and its sources.

A source hands out one batch of fragments per call and says when its producers cannot produce any more
(raising instead of returning ``None`` forever), so a trainer never waits on a dead pipeline.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from rollhub.experience import SampleFragment


@runtime_checkable
class FragmentSource(Protocol):
    """The trainer's view of the experience it trains on (step path)."""

    def next_batch(self, wait_s: float) -> list[SampleFragment] | None:
        """The next batch (``batch_size`` fragments), waiting up to ``wait_s`` seconds; ``None`` if none came.

        Raises:
            RollhubError: the producers are gone (the message says what to do).
        """
        ...

    def publish_version(self, version: int) -> None:
        """The trainer now holds policy ``version``: the source's staleness bound compares against it from now
        on (a buffer drops what became too stale), so its clock and the trainer's cannot drift."""
        ...


class RayReplaySource:
    """Batches from a :class:`rollhub.rollout.replay.ReplayBuffer` actor fed by a rollout fleet.

    Args:
        replay: the replay-buffer actor handle.
        fleet: the :class:`rollhub.rollout.fleet.FleetClient` feeding it; checked whenever no batch comes, so a
            fleet that cannot produce raises ``FleetError`` here.
        timeout_s: how much longer than ``wait_s`` a call may take before Ray's timeout error propagates.
    """

    def __init__(self, replay: Any, fleet: Any = None, timeout_s: float = 60.0) -> None:
        self.replay = replay
        self.fleet = fleet
        self.timeout_s = timeout_s

    def next_batch(self, wait_s: float) -> list[SampleFragment] | None:
        """One served batch's fragments, or ``None`` after ``wait_s`` (then the fleet is checked)."""
        import ray

        batch = ray.get(self.replay.next_batch.remote(wait_s), timeout=wait_s + self.timeout_s)
        if batch is None:
            if self.fleet is not None:
                self.fleet.check()
            return None
        return list(batch.items)

    def publish_version(self, version: int) -> None:
        """Tell the replay buffer the trainer's version and wait for it to take it (the actor runs calls
        concurrently, so only waiting orders it before this trainer's next ``next_batch``)."""
        import ray

        ray.get(self.replay.publish_version.remote(version), timeout=self.timeout_s)
