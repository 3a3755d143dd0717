"""What the buffer table answers, as typed values; the server turns them into AtroposLib's JSON (the env
registry's answers are in :mod:`rollhub.buffer.envs`).

Nothing here knows the wire format: :mod:`rollhub.server.shapes` writes each value as the JSON the matching
route has always answered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BufferStatus:
    """The queue at a glance (fields in the order ``/status`` answers them).

    Attributes:
        current_step: batches served so far in this run (plus the run's ``starting_step``).
        queue_size: groups queued (served whole; held parts are not counted).
        queued_sequences: sequences in those groups.
        held_sequences: sequences held until parts make a whole group.
        leased_batches: batches leased and neither acknowledged nor expired.
        max_queued_sequences: the backpressure bound (``None``: unbounded).
        max_staleness: the staleness bound (``None``: unbounded).
        stale_dropped: items dropped as too stale, per ``str(env_id)``.
        serve_failures: batches formed but not delivered (put back whole).
        storage: the backend's health figures.
        policy_version: the latest version the trainer published (``None`` before the first publish).
        next_batch_version: the version the trainer will train the next batch served at: ``policy_version``,
            plus one once a batch was served since it was published (``None`` before the first publish); what
            a producer's admission control budgets against.
    """

    current_step: int
    queue_size: int
    queued_sequences: int
    held_sequences: int
    leased_batches: int
    max_queued_sequences: int | None
    max_staleness: int | None
    stale_dropped: dict[str, int]
    serve_failures: int
    storage: dict[str, Any] = field(default_factory=dict)
    policy_version: int | None = None
    next_batch_version: int | None = None


@dataclass(frozen=True)
class Ingested:
    """What became of one ingested group.

    Attributes:
        held_sequences: ``None``: queued as it came. Else it (or the parts it completed) went to the env's held
            parts, and this many sequences of that env are held now (0: the parts were merged and queued).
    """

    held_sequences: int | None = None

    @property
    def buffered(self) -> bool:
        return self.held_sequences is not None


@dataclass(frozen=True)
class VersionPublished:
    """The answer to a published policy version: the version now current and the items it made too stale."""

    policy_version: int
    stale_dropped: int
