"""What the buffer core answers, as typed values; the server turns them into AtroposLib's JSON.

Nothing here knows the wire format: :mod:`rollhub.server.shapes` writes each value as the JSON the matching
route has always answered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollhub.buffer.types import TrainerRun

if TYPE_CHECKING:
    from rollhub.buffer.envs import EnvRecord


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


@dataclass(frozen=True)
class EnvRegistration:
    """The answer to an environment registering.

    Attributes:
        env: the new env's record; ``None`` when the trainer has not asked for its first batch yet, and the
            environment should register again shortly (nothing was registered).
        run: the trainer's run (``None`` only when ``env`` is ``None``).
        starting_step: the trainer step now.
    """

    env: EnvRecord | None
    run: TrainerRun | None
    starting_step: int


@dataclass(frozen=True)
class EnvStatus:
    """AtroposLib 0.4.0's ``/status-env`` figures for one env, in its key order (see :func:`.envs.status_env`).

    ``queue_size`` and ``self_queue_size`` are in units of the env's group size.
    """

    current_step: int
    queue_size: int
    unallocated_fraction: float
    self_queue_size: int
    max_group_size: int
    env_weight: float


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
