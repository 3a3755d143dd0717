"""Admission (backpressure): the bound on waiting sequences, and the leases that hold served batches.

* :class:`QueueBound` refuses new data that would take the waiting sequences (queued plus held) past
  ``max_queued_sequences``. Accepted data is never evicted; a refused request stores nothing.
* :class:`Leases` keeps batches served with a lease until they are acknowledged. A lease whose deadline
  (wall clock) passed is *expired*: its batch is served again, whole, before anything else, as the same step.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rollhub.buffer.storage import Entry
from rollhub.buffer.types import Lease
from rollhub.errors import QueueFull, UnknownBatch


@dataclass(frozen=True)
class QueueBound:
    """The bound on waiting sequences (``None``: unbounded) and the wait suggested to refused producers."""

    max_sequences: int | None = None
    retry_after_s: float = 1.0

    def admit(self, waiting: int, incoming: int) -> None:
        """Allow ``incoming`` more sequences beside ``waiting`` ones, or raise.

        An empty queue takes any request, so a single request larger than the bound is not refused forever.

        Raises:
            QueueFull: the request would pass the bound; nothing of it may be stored.
        """
        bound = self.max_sequences
        if bound is not None and waiting and waiting + incoming > bound:
            raise QueueFull(
                f"the queue holds {waiting} sequences and the bound is {bound}; retry after "
                f"{self.retry_after_s:g} s (nothing of this request was stored)",
                retry_after_s=self.retry_after_s,
            )


class Leases:
    """Leased batches by batch id, in the order they were leased.

    The coordinator persists :meth:`to_json` (deadlines, steps, expiry) in the storage meta and the leased items
    as stored rows in state ``leased``; :meth:`restore` rebuilds both after a restart.
    """

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def active(self) -> int:
        """Leases not yet expired."""
        return sum(1 for lease in self._leases.values() if not lease.expired)

    def restore(self, lease_id: str, entry: Entry, meta: dict[str, Any], step: int) -> None:
        """Add one stored leased item to its lease (a lease missing from ``meta`` comes back expired)."""
        info = meta.get(lease_id, {"step": step, "deadline": 0.0, "expired": True})
        lease = self._leases.get(lease_id)
        if lease is None:
            lease = self._leases[lease_id] = Lease([], info["step"], info["deadline"], info["expired"])
        lease.entries.append(entry)

    def expire(self, now: float) -> int:
        """Mark leases past their deadline as expired; how many newly expired."""
        expired = [lease for lease in self._leases.values() if not lease.expired and lease.deadline < now]
        for lease in expired:
            lease.expired = True
        return len(expired)

    def take_expired(self) -> Lease | None:
        """Remove and return the oldest expired lease (its batch is due again), or None."""
        for batch_id, lease in self._leases.items():
            if lease.expired:
                del self._leases[batch_id]
                return lease
        return None

    def grant(self, entries: list[Entry], step: int, deadline: float) -> str:
        """Lease a batch until ``deadline``; its new batch id."""
        batch_id = uuid.uuid4().hex
        self._leases[batch_id] = Lease(entries, step, deadline)
        return batch_id

    def release(self, batch_id: str) -> Lease:
        """Remove the lease of an acknowledged batch.

        Raises:
            UnknownBatch: ``batch_id`` is not leased.
        """
        lease = self._leases.pop(batch_id, None)
        if lease is None:
            raise UnknownBatch(
                f"batch {batch_id!r} is not leased: never issued, already acknowledged, "
                "or expired and served again under a new id"
            )
        return lease

    def forget(self, gids: set[int]) -> None:
        """Drop items storage quarantined; a lease left empty goes."""
        for batch_id, lease in list(self._leases.items()):
            lease.entries = [e for e in lease.entries if e.gid not in gids]
            if not lease.entries:
                del self._leases[batch_id]

    def snapshot(self) -> dict[str, tuple[Lease, list[Entry], bool]]:
        """What :meth:`rollback` needs to undo any change made after it (leases are few)."""
        return {bid: (lease, lease.entries, lease.expired) for bid, lease in self._leases.items()}

    def rollback(self, snapshot: dict[str, tuple[Lease, list[Entry], bool]]) -> None:
        """Return to ``snapshot``."""
        self._leases = {}
        for bid, (lease, entries, expired) in snapshot.items():
            lease.entries, lease.expired = entries, expired
            self._leases[bid] = lease

    def to_json(self) -> dict[str, Any]:
        return {bid: lease.to_json() for bid, lease in self._leases.items()}

    def entries(self) -> Iterable[Entry]:
        """Every leased item."""
        for lease in self._leases.values():
            yield from lease.entries
