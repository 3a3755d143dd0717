"""The queue of the experience buffer: queued entries, oldest first, with what a poll needs kept up to date.

A poll (one attempt to form a batch) must not cost time in proportion to the queue: it reads the running
figures kept here (sequences queued, the largest group size, per-env counts), drops stale items through a
per-version index (work in proportion to what is dropped), and walks the queue from its head only as far as
the batch former needs. Removing served entries costs in proportion to the batch.

Changes can be journaled (:meth:`Queue.begin`) and undone (:meth:`Queue.rollback`) when storing them fails,
so the coordinator never copies the queue to be able to restore it.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from rollhub.buffer.storage import Entry


@dataclass
class EnvQueued:
    """What one env (or ``None``: items without an env) has queued: groups, sequences, and group sizes."""

    groups: int = 0
    sequences: int = 0
    sizes: Counter[int] = field(default_factory=Counter)


class Queue:
    """Queued entries in arrival order (restored ones in their stored order).

    Invariants: iteration is oldest first; ``sequences`` is the sum of the sizes; every entry with a
    ``policy_version`` is in the version index under that version; positions increase along the queue.
    """

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self._items: OrderedDict[int, tuple[int, Entry]] = OrderedDict()  # gid -> (position, entry)
        self._next = 0
        self._by_version: dict[int, dict[int, Entry]] = {}
        self._versions: list[int] = []  # heap of versions in the index (may hold versions since emptied)
        self._sizes: Counter[int] = Counter()
        self._by_env: dict[int | None, EnvQueued] = {}
        self.sequences = 0
        self.changes = 0  # counts every change (undone ones too): equal counts mean an unchanged queue
        self._journal: list[tuple[int, Entry | int]] | None = None
        for entry in entries:
            self.append(entry)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Entry]:
        for _, entry in self._items.values():
            yield entry

    def __contains__(self, gid: int) -> bool:
        return gid in self._items

    def last(self) -> Entry | None:
        """The newest entry, or None when empty."""
        return next(reversed(self._items.values()))[1] if self._items else None

    def max_size(self) -> int:
        """The largest group size queued (0 when empty); costs the number of distinct sizes."""
        return max(self._sizes, default=0)

    def by_env(self) -> dict[int | None, EnvQueued]:
        """Per env: groups, sequences and sizes queued (only envs with something queued). Do not modify."""
        return self._by_env

    # ------------------------------------------------------------------ changes
    def append(self, entry: Entry) -> None:
        """Queue ``entry`` last."""
        self._items[entry.gid] = (self._next, entry)
        self._next += 1
        self._index(entry)
        if self._journal is not None:
            self._journal.append((-1, entry.gid))

    def remove(self, entries: Iterable[Entry]) -> None:
        """Take ``entries`` (all queued) off the queue."""
        for entry in entries:
            position, _ = self._items.pop(entry.gid)
            self._unindex(entry)
            if self._journal is not None:
                self._journal.append((position, entry))

    def forget(self, gids: set[int]) -> None:
        """Take the entries with these gids off the queue, where queued."""
        self.remove([self._items[g][1] for g in gids if g in self._items])

    def drop_older_than(self, floor: int) -> list[Entry]:
        """Take off and return every entry whose ``policy_version`` is below ``floor`` (unversioned stay)."""
        dropped: list[Entry] = []
        while self._versions and self._versions[0] < floor:
            bucket = self._by_version.get(heapq.heappop(self._versions))  # a version may be in the heap twice
            if bucket:
                entries = list(bucket.values())
                self.remove(entries)
                dropped.extend(entries)
        return dropped

    def _index(self, entry: Entry) -> None:
        self.changes += 1
        self.sequences += entry.size
        self._sizes[entry.size] += 1
        row = self._by_env.get(entry.env_id)
        if row is None:
            row = self._by_env[entry.env_id] = EnvQueued()
        row.groups += 1
        row.sequences += entry.size
        row.sizes[entry.size] += 1
        version = entry.policy_version
        if version is not None:
            bucket = self._by_version.get(version)
            if bucket is None:
                bucket = self._by_version[version] = {}
                heapq.heappush(self._versions, version)
                if len(self._versions) > 2 * len(self._by_version) + 64:  # versions emptied by serving pile up
                    self._versions = list(self._by_version)
                    heapq.heapify(self._versions)
            bucket[entry.gid] = entry

    def _unindex(self, entry: Entry) -> None:
        self.changes += 1
        self.sequences -= entry.size
        _decrement(self._sizes, entry.size)
        row = self._by_env[entry.env_id]
        row.groups -= 1
        row.sequences -= entry.size
        _decrement(row.sizes, entry.size)
        if not row.groups:
            del self._by_env[entry.env_id]
        version = entry.policy_version
        if version is not None:
            bucket = self._by_version[version]
            del bucket[entry.gid]
            if not bucket:
                del self._by_version[version]

    # ------------------------------------------------------------------ journal
    def begin(self) -> None:
        """Start recording changes, so :meth:`rollback` can undo them."""
        self._journal = []

    def commit(self) -> None:
        """Keep the recorded changes and stop recording."""
        self._journal = None

    def rollback(self) -> None:
        """Undo every change since :meth:`begin`: removed entries return to their places, added ones go."""
        journal, self._journal = self._journal or [], None
        taken: dict[int, tuple[int, Entry]] = {}
        for position, item in reversed(journal):
            if position >= 0:
                taken[item.gid] = (position, item)  # type: ignore[union-attr]
            elif item in taken:  # added and taken off again within the same change
                del taken[item]  # type: ignore[arg-type]
            else:
                self._unindex(self._items.pop(item)[1])  # type: ignore[call-overload]
        removed = list(taken.values())
        if not removed:
            return
        removed.sort(key=lambda pe: pe[0])
        head = next(iter(self._items.values()))[0] if self._items else None
        for position, entry in removed:
            self._items[entry.gid] = (position, entry)
            self._index(entry)
        if head is not None and removed[-1][0] > head:  # not a prefix (rare): restore the order by position
            self._items = OrderedDict(sorted(self._items.items(), key=lambda kv: kv[1][0]))
        elif head is not None:
            for _, entry in reversed(removed):
                self._items.move_to_end(entry.gid, last=False)


def _decrement(counter: Counter[int], key: int) -> None:
    counter[key] -= 1
    if not counter[key]:
        del counter[key]
