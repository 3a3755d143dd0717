"""Batch formation: which queued groups make the next batch (pure functions over queue metadata).

Both rules are those of AtroposLib 0.4.0, so mixed Atropos deployments batch the same way:

* **Heterogeneous packing.** ``batch_size`` counts sequences and groups are never split. Groups of one size
  class are gathered into packs whose sequences add up to the largest group size in the queue; a batch is
  made of whole packs taken in the order they complete, oldest first. A batch that would overshoot
  ``batch_size`` is not formed (so group sizes should divide the batch size, as with powers of two).
* **Minimum allocations.** Each connected env with ``min_batch_allocation`` first gets packable groups up to
  ``int(batch_size * fraction)`` sequences (scaled down proportionally when the minimums add up to more than
  the batch), then any packable group fills the rest in queue order. An env with a minimum but nothing
  packable means no batch.

The functions return indices into the given entry list, or None when no batch can be formed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class Sized(Protocol):
    """What batch formation needs to know of a queued group."""

    @property
    def size(self) -> int: ...

    @property
    def env_id(self) -> int | None: ...


def _packable(sizes: Sequence[int], max_size: int) -> list[int]:
    """Indices of groups that complete a pack of ``max_size`` sequences, in completion order."""
    pending: dict[int, list[int]] = {}
    out: list[int] = []
    for i, size in enumerate(sizes):
        bucket = pending.setdefault(size, [])
        bucket.append(i)
        if len(bucket) * size == max_size:
            out.extend(bucket)
            bucket.clear()
    return out


def pack_heterogeneous(entries: Sequence[Sized], batch_size: int) -> list[int] | None:
    """Pick exactly ``batch_size`` sequences of whole groups by the packing rule, or None."""
    if not entries or batch_size <= 0:
        return None
    sizes = [e.size for e in entries]
    if sum(sizes) < batch_size:
        return None
    chosen: list[int] = []
    running = 0
    for i in _packable(sizes, max(sizes)):
        chosen.append(i)
        running += sizes[i]
        if running == batch_size:
            return chosen
        if running > batch_size:
            return None
    return None


def pack_with_minimums(entries: Sequence[Sized], batch_size: int, minimums: Mapping[int, float]) -> list[int] | None:
    """Pick ``batch_size`` sequences honouring per-env minimum fractions, or None.

    Args:
        entries: the queue, oldest first.
        batch_size: sequences per batch.
        minimums: env_id -> minimum fraction of the batch, for connected envs that set one.
    """
    if not entries:
        return None
    if not minimums:
        return pack_heterogeneous(entries, batch_size)
    max_size = max(e.size for e in entries)
    # Packs are formed per env: a pack never mixes environments here.
    per_env: dict[int, list[int]] = {}
    present: set[int] = set()
    for env_id in {e.env_id for e in entries if e.env_id is not None}:
        idx = [i for i, e in enumerate(entries) if e.env_id == env_id]
        present.add(env_id)
        per_env[env_id] = [idx[j] for j in _packable([entries[i].size for i in idx], max_size)]
    wanted: dict[int, int] = {}
    for env_id, fraction in minimums.items():
        need = int(batch_size * fraction)
        if need > 0:
            if env_id not in present or not per_env.get(env_id):
                return None
            wanted[env_id] = need
    total = sum(wanted.values())
    if total > batch_size:
        scale = batch_size / total
        for env_id in wanted:
            smallest = min(entries[i].size for i in per_env[env_id])
            wanted[env_id] = max(smallest, int(wanted[env_id] * scale))
    chosen: list[int] = []
    taken: set[int] = set()
    running = 0
    for env_id, need in wanted.items():
        got = 0
        for i in per_env[env_id]:
            if got >= need:
                break
            size = entries[i].size
            if running + size <= batch_size:
                chosen.append(i)
                taken.add(i)
                got += size
                running += size
    if running < batch_size:
        packable = sorted(i for idx in per_env.values() for i in idx if i not in taken)
        for i in packable:
            size = entries[i].size
            if running + size <= batch_size:
                chosen.append(i)
                running += size
            if running == batch_size:
                break
    return chosen if running == batch_size else None
