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


class _FleetFedSource:
    """A replay buffer fed by a fleet: ``None`` after ``wait_s`` makes it check the fleet, so a fleet that
    cannot produce raises ``FleetError`` instead of leaving the trainer waiting."""

    def __init__(self, fleet: Any) -> None:
        self.fleet = fleet

    def _serve(self, wait_s: float) -> Any:
        raise NotImplementedError

    def next_batch(self, wait_s: float) -> list[SampleFragment] | None:
        """One served batch's fragments, or ``None`` after ``wait_s`` (then the fleet is checked)."""
        batch = self._serve(wait_s)
        if batch is None:
            if self.fleet is not None:
                self.fleet.check()
            return None
        return list(batch.items)


class RayReplaySource(_FleetFedSource):
    """Batches from a :class:`rollhub.rollout.replay.ReplayBuffer` actor fed by a rollout fleet.

    Args:
        replay: the replay-buffer actor handle.
        fleet: the :class:`rollhub.rollout.backends.ray.FleetClient` feeding it; checked whenever no batch comes, so a
            fleet that cannot produce raises ``FleetError`` here.
        timeout_s: how much longer than ``wait_s`` a call may take before Ray's timeout error propagates.
    """

    def __init__(self, replay: Any, fleet: Any = None, timeout_s: float = 60.0) -> None:
        super().__init__(fleet)
        self.replay = replay
        self.timeout_s = timeout_s

    def _serve(self, wait_s: float) -> Any:
        import ray

        return ray.get(self.replay.next_batch.remote(wait_s), timeout=wait_s + self.timeout_s)

    def publish_version(self, version: int) -> None:
        """Tell the replay buffer the trainer's version and wait for it to take it (the actor runs calls
        concurrently, so only waiting orders it before this trainer's next ``next_batch``)."""
        import ray

        ray.get(self.replay.publish_version.remote(version), timeout=self.timeout_s)


class LocalReplaySource(_FleetFedSource):
    """Batches from a :class:`rollhub.rollout.replay.ReplayBuffer` in this process, fed by a
    :class:`rollhub.rollout.backends.local.LocalFleet` (checked whenever no batch comes, as above).

    Args:
        replay: the buffer.
        fleet: the fleet feeding it, or ``None``.
    """

    def __init__(self, replay: Any, fleet: Any = None) -> None:
        super().__init__(fleet)
        self.replay = replay

    def _serve(self, wait_s: float) -> Any:
        return self.replay.next_batch(wait_s)

    def publish_version(self, version: int) -> None:
        """The trainer now holds ``version`` (the buffer's staleness bound compares against it from now on)."""
        self.replay.publish_version(version)
