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
    lease_expiries: int = 0
    stale_dropped: dict[str, int] = field(default_factory=dict)
    # per env_id (None: groups posted without one): [groups, sequences]
    ingested_by_env: dict[int | None, list[int]] = field(default_factory=dict)
    served_by_env: dict[int | None, list[int]] = field(default_factory=dict)

    def count_ingested(self, env_id: int | None, sequences: int) -> None:
        """One group (or item) of ``sequences`` accepted for ``env_id``."""
        row = self.ingested_by_env.setdefault(env_id, [0, 0])
        row[0] += 1
        row[1] += sequences

    def count_served(self, entries: list[Entry]) -> None:
        """The groups of one served batch, per env (redeliveries count again, like ``sequences_out``)."""
        for e in entries:
            row = self.served_by_env.setdefault(e.env_id, [0, 0])
            row[0] += 1
            row[1] += e.size
