"""The buffer's in-process values: its configuration, a served batch, leases and counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollhub.buffer.storage import Entry


@dataclass(frozen=True)
class BufferConfig:
    """Behaviour knobs of the buffer (all off by default, which is AtroposLib 0.4.0's behaviour).

    Attributes:
        max_staleness: serve no item whose ``policy_version`` is older than ``current_step - max_staleness``.
        max_queued_sequences: refuse new data (QueueFull, HTTP 429) that would take the waiting sequences
            past this bound; accepted data is never evicted.
        retry_after_s: the wait suggested to refused producers.
    """

    max_staleness: int | None = None
    max_queued_sequences: int | None = None
    retry_after_s: float = 1.0


@dataclass
class Batch:
    """One served batch. ``step`` is the trainer step it counts as; ``batch_id`` is set when leased."""

    items: list[Any]
    entries: list[Entry]
    step: int
    batch_id: str | None = None
    deadline: float | None = None

    @property
    def sequences(self) -> int:
        return sum(e.size for e in self.entries)


@dataclass
class Lease:
    """A served batch awaiting ``ack``: its items, the step it counts as, and when it expires (wall clock)."""

    entries: list[Entry]
    step: int
    deadline: float
    expired: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "deadline": self.deadline, "expired": self.expired}


@dataclass
class Counters:
    """Monotonic counters since process start (exported as metrics)."""

    groups_in: int = 0
    sequences_in: int = 0
    tokens_in: int = 0
    batches_out: int = 0
    sequences_out: int = 0
    refused_full: int = 0
    redelivered: int = 0
    serve_failures: int = 0  # batches formed but not delivered (encoding or storing failed): put back whole
    stale_dropped: dict[str, int] = field(default_factory=dict)
