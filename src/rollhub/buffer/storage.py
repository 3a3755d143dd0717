"""Storage backends of the experience buffer, behind one small interface, chosen by URL.

The buffer table keeps all queue *metadata* in memory and writes every change through
:meth:`Storage.apply` as one atomic :class:`Transaction`; payloads (the groups themselves) live in the
backend and are read back only when a batch is served. ``load()`` returns what a restarted server needs
to rebuild its state. A durable backend writes payloads with the :class:`Codec` its builder gives it (the server
gives the group codec of :mod:`rollhub.wire.codec`, the replay buffer its fragment codec); the buffer itself
encodes nothing. :func:`rollhub.buffer.backends.make_storage` picks the backend from a URL.

* ``memory``: payloads in a dict; nothing survives the process.
* ``sqlite:///path.db``: one WAL database; ``apply`` returns only after the transaction commits, so a
  200 answer means the data is in the database file and survives a crash of the server process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rollhub.experience import Group

State = Literal["queued", "held", "leased"]


@dataclass(slots=True)
class Entry:
    """Queue metadata of one stored item (a scored group, or any payload counted as ``size`` sequences).

    Attributes:
        gid: storage key, unique and increasing in arrival order.
        size: sequences it contributes to a batch.
        env_id: the producing environment, or None.
        policy_version: trainer step of the weights that produced it, or None.
        n_tokens: tokens it holds (for metrics).
    """

    gid: int
    size: int
    env_id: int | None = None
    policy_version: int | None = None
    n_tokens: int = 0


@dataclass(slots=True)
class StoredItem:
    """One row as loaded back: its entry, where it was, and its position in the queue order."""

    entry: Entry
    state: State
    order: float
    lease_id: str | None = None


@dataclass
class Transaction:
    """A set of changes applied atomically: all of them or none."""

    puts: list[tuple[Entry, Any, State, float]] = field(default_factory=list)
    deletes: list[int] = field(default_factory=list)
    moves: list[tuple[list[int], State, str | None, float | None]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    clear: bool = False  # delete every stored item and meta value first

    def put(self, entry: Entry, payload: Any, state: State, order: float) -> None:
        self.puts.append((entry, payload, state, order))

    def move(self, gids: list[int], state: State, lease_id: str | None = None, order: float | None = None) -> None:
        """Change the state (and optionally the lease and queue position) of stored items."""
        self.moves.append((gids, state, lease_id, order))

    def __bool__(self) -> bool:
        return bool(self.puts or self.deletes or self.moves or self.meta or self.clear)


@dataclass(frozen=True)
class Codec:
    """How a durable backend writes payloads as bytes and reads them back.

    Attributes:
        encode: payload -> bytes; raises ``TypeError`` or ``AttributeError`` for a payload it cannot write.
        decode: bytes -> payload; raises ``ValueError``, ``KeyError``, ``TypeError`` or a ``RollhubError`` for bytes
            it cannot read (the backend quarantines the item).
        holds: what the payloads are, for error messages (e.g. "scored groups").
        reuses_wire: a payload's ``wire`` attribute, when set, holds the bytes it arrived as, and those are already
            its encoding under this codec: they are stored as they are, not encoded again.
    """

    encode: Callable[[Any], bytes | memoryview]
    decode: Callable[[bytes], Any]
    holds: str = "payloads"
    reuses_wire: bool = False


@dataclass
class StoredState:
    """Everything a backend holds, as ``load()`` returns it: items in queue order and the meta values."""

    items: list[StoredItem] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


class Storage(ABC):
    """Where the buffer keeps items and its small state. Implementations must make ``apply`` atomic."""

    url: str = ""
    durable: bool = False

    @abstractmethod
    def load(self) -> StoredState:
        """Everything stored, for rebuilding the buffer after a restart."""

    @abstractmethod
    def apply(self, tx: Transaction) -> None:
        """Apply all changes of ``tx`` atomically; on return they are stored."""

    @abstractmethod
    def payloads(self, gids: Sequence[int]) -> list[Any]:
        """The payloads of ``gids``, in that order.

        Raises:
            ItemsDamaged: stored items that cannot be read back intact; the backend has quarantined them, and the
                caller drops them from its queue.
        """

    def stats(self) -> dict[str, Any]:
        """Health figures of the backend for ``/status`` (e.g. quarantined items, a full disk); none by default."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release files and connections."""


class MemoryStorage(Storage):
    """Payloads in a dict: fastest, and nothing survives the process."""

    url = "memory"
    durable = False

    def __init__(self) -> None:
        self._items: dict[int, tuple[Any, StoredItem]] = {}
        self._meta: dict[str, Any] = {}

    def load(self) -> StoredState:
        rows = sorted((row for _, row in self._items.values()), key=lambda r: r.order)
        return StoredState(items=rows, meta=dict(self._meta))

    def apply(self, tx: Transaction) -> None:
        if tx.clear:
            self._items.clear()
            self._meta.clear()
        for entry, payload, state, order in tx.puts:
            if isinstance(payload, Group):
                payload = payload.compacted()
            self._items[entry.gid] = (payload, StoredItem(entry, state, order))
        for gid in tx.deletes:
            self._items.pop(gid, None)
        for gids, state, lease_id, order in tx.moves:
            for gid in gids:
                row = self._items[gid][1]
                row.state, row.lease_id = state, lease_id
                if order is not None:
                    row.order = order
        self._meta.update(tx.meta)

    def payloads(self, gids: Sequence[int]) -> list[Any]:
        items = self._items
        return [items[g][0] for g in gids]
