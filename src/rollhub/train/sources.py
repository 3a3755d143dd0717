"""Where a trainer's batches of fragments come from: the :class:`FragmentSource` protocol.

A source hands out one batch of fragments per call and says when its producers cannot produce any more
(raising instead of returning ``None`` forever), so a trainer never waits on a dead pipeline. The sources that
read a fleet's replay buffer are :class:`rollhub.run.sources.RayReplaySource` and
:class:`rollhub.run.sources.LocalReplaySource`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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
