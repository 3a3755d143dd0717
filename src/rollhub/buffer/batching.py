"""The batch former: which queued groups make the next batch (pure functions over queue metadata).

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
:class:`BatchFormer` applies one rule to the buffer's :class:`~rollhub.buffer.queue.Queue`; its named
constructors (:meth:`BatchFormer.packing`, :meth:`BatchFormer.with_minimums`) say which.

The table (:class:`rollhub.buffer.table.Table`) takes one batch rule (:class:`rollhub.buffer.table.BatchRule`):
:class:`PackingRule` is AtroposLib's (with the minimums of a live env registry, or none), :class:`FragmentRule`
the replay buffer's (the oldest items, whole, in arrival order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from rollhub.buffer.queue import Queue
    from rollhub.buffer.storage import Entry

T = TypeVar("T")


class Sized(Protocol):
    """What batch formation needs to know of a queued group."""

    @property
    def size(self) -> int: ...

    @property
    def env_id(self) -> int | None: ...


def _completed_packs(items: Iterable[tuple[int, T]], max_size: int) -> Iterator[tuple[int, T]]:
    """``(size, item)`` pairs of groups that complete a pack of ``max_size`` sequences, in completion order.

    Lazy: the caller stops reading once it has a batch, so only the head of the queue is walked.
    """
    pending: dict[int, list[tuple[int, T]]] = {}
    for size, item in items:
        bucket = pending.get(size)
        if bucket is None:
            bucket = pending[size] = []
        bucket.append((size, item))
        if len(bucket) * size == max_size:
            yield from bucket
            bucket.clear()


def _packable(sizes: Sequence[int], max_size: int) -> list[int]:
    """Indices of groups that complete a pack of ``max_size`` sequences, in completion order."""
    return [i for _, i in _completed_packs(((s, i) for i, s in enumerate(sizes)), max_size)]


def _take_packs(items: Iterable[tuple[int, T]], batch_size: int, max_size: int) -> list[T] | None:
    """Whole packs, in completion order, adding up to exactly ``batch_size`` sequences; None if they overshoot."""
    chosen: list[T] = []
    running = 0
    for size, item in _completed_packs(items, max_size):
        chosen.append(item)
        running += size
        if running == batch_size:
            return chosen
        if running > batch_size:
            return None
    return None


def pack_heterogeneous(entries: Sequence[Sized], batch_size: int) -> list[int] | None:
    """Pick exactly ``batch_size`` sequences of whole groups by the packing rule, or None."""
    if not entries or batch_size <= 0:
        return None
    sizes = [e.size for e in entries]
    if sum(sizes) < batch_size:
        return None
    return _take_packs(((s, i) for i, s in enumerate(sizes)), batch_size, max(sizes))


def _wanted(
    entries: Sequence[Sized], batch_size: int, minimums: Mapping[int, float], per_env: Mapping[int, list[int]]
) -> dict[int, int] | None:
    """Sequences each env with a minimum must get (scaled down when they add up to more than the batch); None when
    an env with a minimum has nothing packable."""
    wanted: dict[int, int] = {}
    for env_id, fraction in minimums.items():
        need = int(batch_size * fraction)
        if need > 0:
            if not per_env.get(env_id):
                return None
            wanted[env_id] = need
    total = sum(wanted.values())
    if total > batch_size:
        scale = batch_size / total
        for env_id in wanted:
            smallest = min(entries[i].size for i in per_env[env_id])
            wanted[env_id] = max(smallest, int(wanted[env_id] * scale))
    return wanted


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
    for env_id in {e.env_id for e in entries if e.env_id is not None}:
        idx = [i for i, e in enumerate(entries) if e.env_id == env_id]
        per_env[env_id] = [idx[j] for j in _packable([entries[i].size for i in idx], max_size)]
    wanted = _wanted(entries, batch_size, minimums, per_env)
    if wanted is None:
        return None
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


class BatchFormer:
    """One batch formation rule over the buffer's queue; build it with a named constructor.

    ``form`` returns the entries of the next batch (in the order the rule picked them) or None; it never changes
    the queue. The packing rule reads the queue's running figures and walks it only until the batch is complete;
    the minimum-allocation rule looks at every env's packs, so it walks the whole queue.
    """

    def __init__(self, minimums: Mapping[int, float] | None) -> None:
        self._minimums = minimums

    @classmethod
    def packing(cls) -> BatchFormer:
        """AtroposLib 0.4.0's heterogeneous packing (no env has a minimum allocation)."""
        return cls(None)

    @classmethod
    def with_minimums(cls, minimums: Mapping[int, float]) -> BatchFormer:
        """Packing that first gives each env its minimum fraction of the batch (env_id -> fraction)."""
        return cls(dict(minimums))

    @property
    def rule(self) -> tuple[tuple[int, float], ...] | None:
        """The rule as a comparable value: None for packing, else the minimums (same rule, same batches)."""
        return None if self._minimums is None else tuple(sorted(self._minimums.items()))

    def form(self, queue: Queue, batch_size: int) -> list[Entry] | None:
        """The entries of the next batch of exactly ``batch_size`` sequences, or None."""
        if self._minimums is None:
            if not len(queue) or batch_size <= 0 or queue.sequences < batch_size:
                return None
            return _take_packs(((e.size, e) for e in queue), batch_size, queue.max_size())
        entries = list(queue)
        picked = pack_with_minimums(entries, batch_size, self._minimums)
        return None if picked is None else [entries[i] for i in picked]


class PackingRule:
    """AtroposLib 0.4.0's batch rule for the table: heterogeneous packing, with per-env minimum allocations when
    ``minimums`` (read at every attempt, so registrations and disconnects take effect at once) names any.

    Args:
        minimums: env_id -> minimum fraction, for the connected envs that set one; None: never any.
    """

    _packing = BatchFormer.packing()

    def __init__(self, minimums: Callable[[], Mapping[int, float]] | None = None) -> None:
        self._minimums = minimums

    def key(self) -> tuple[tuple[int, float], ...] | None:
        """None for plain packing, else the minimums (same key, same queue: same batch)."""
        wanted = self._minimums() if self._minimums is not None else None
        return tuple(sorted(wanted.items())) if wanted else None

    def form(self, queue: Queue, batch_size: int) -> list[Entry] | None:
        wanted = self._minimums() if self._minimums is not None else None
        former = BatchFormer.with_minimums(wanted) if wanted else self._packing
        return former.form(queue, batch_size)


class FragmentRule:
    """The replay buffer's batch rule: the oldest items in arrival order, whole, adding up to exactly
    ``batch_size`` sequences (fragments count one each, so a batch is the ``batch_size`` oldest); None when the
    oldest overshoot it or too few are queued. It walks only the head of the queue."""

    def key(self) -> str:
        return "fragments"

    def form(self, queue: Queue, batch_size: int) -> list[Entry] | None:
        if batch_size <= 0 or queue.sequences < batch_size:
            return None
        chosen: list[Entry] = []
        total = 0
        for entry in queue:
            chosen.append(entry)
            total += entry.size
            if total >= batch_size:
                break
        return chosen if total == batch_size else None
