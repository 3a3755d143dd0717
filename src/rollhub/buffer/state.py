"""The experience buffer's state: its parts, restored from storage, and the transaction discipline over them.

:class:`BufferState` owns the lock, the parts (run and envs, queue, held parts, leases, staleness clock,
counters) and :meth:`BufferState._atomic`, which undoes in-memory changes when storing them fails. The
operations are :class:`rollhub.buffer.core.ExperienceBuffer`'s.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rollhub.buffer.admission import Leases, QueueBound
from rollhub.buffer.envs import EnvRecord
from rollhub.buffer.held import HeldGroups
from rollhub.buffer.observe import ServeObserver
from rollhub.buffer.queue import Queue
from rollhub.buffer.staleness import StalenessClock
from rollhub.buffer.storage import Entry, Storage, StoredState, Transaction
from rollhub.buffer.types import BufferConfig, Counters, TrainerRun
from rollhub.errors import NotRegistered
from rollhub.experience import Group, StalenessPolicy
from rollhub.experience.episodes import episode_count

RESET_META: dict[str, Any] = {
    "run": None,
    "started": False,
    "step": 0,
    "envs": [],
    "leases": {},
    "stale": {},
    "policy_version": None,
}


class BufferState:
    """The buffer's parts and its one lock; :meth:`_atomic` keeps memory and storage in agreement.

    Every change to the parts happens under ``_lock``, inside :meth:`_atomic` when several parts change, and is
    written through ``storage`` as one transaction before the lock is released.

    Args:
        storage: where items and state are kept (see :func:`rollhub.buffer.make_storage`).
        config: staleness and backpressure bounds.
        clock: wall-clock seconds, for lease deadlines and item ages.
    """

    def __init__(self, storage: Storage, config: BufferConfig | None = None, clock: Callable[[], float] = time.time):
        self.storage = storage
        self.config = config or BufferConfig()
        self.bound = QueueBound(self.config.max_queued_sequences, self.config.retry_after_s)
        self._clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.counters = Counters()
        self.observed = ServeObserver()
        self._restore(storage.load())

    # ------------------------------------------------------------------ state
    def _restore(self, stored: StoredState) -> None:
        meta = stored.meta
        run = meta.get("run")
        self.run: TrainerRun | None = None if run is None else TrainerRun(**run)
        self.started: bool = bool(meta.get("started", False))
        self.step: int = int(meta.get("step", 0))
        self.envs = [EnvRecord(**e) for e in meta.get("envs", [])]
        self.staleness = StalenessClock(StalenessPolicy(self.config.max_staleness), meta.get("policy_version"))
        self.counters.stale_dropped = dict(meta.get("stale", {}))
        self._uuids: list[int] = []
        self.queue = Queue(row.entry for row in stored.items if row.state == "queued")
        self.held = HeldGroups()
        self.leases = Leases()
        for row in stored.items:
            if row.state == "held":
                self.held.hold(row.entry.env_id, row.entry)  # type: ignore[arg-type]
            elif row.state == "leased":
                self.leases.restore(row.lease_id, row.entry, meta.get("leases", {}), self.step)  # type: ignore[arg-type]
        self._gids = itertools.count(max((r.entry.gid for r in stored.items), default=0) + 1)
        self._back = max((r.order for r in stored.items), default=0.0) + 1.0
        self._latest: Any | None = None
        self._unformable: tuple[Any, ...] | None = None  # the last attempt that formed no batch

    def _next_order(self) -> float:
        self._back += 1.0
        return self._back

    def _require_run(self) -> TrainerRun:
        if self.run is None:
            raise NotRegistered("no trainer is registered; the trainer must call POST /register first")
        return self.run

    @contextlib.contextmanager
    def _atomic(self) -> Iterator[None]:
        """Undo in-memory changes when storing them fails, so memory never disagrees with storage.

        The queue journals its changes instead of being copied; the rest is small (held parts, leases, counters).
        """
        saved = (self.held.snapshot(), self.leases.snapshot(), self.step, self.counters.copy(), self._latest)
        self.queue.begin()
        try:
            yield
        except BaseException:
            self.queue.rollback()
            held, leases, self.step, self.counters, self._latest = saved
            self.held.rollback(held)
            self.leases.rollback(leases)
            raise
        self.queue.commit()

    def _entry(self, group: Group) -> Entry:
        return Entry(next(self._gids), episode_count(group), group.env_id, group.policy_version, group.n_tokens)

    def _forget(self, gids: set[int]) -> None:
        """Drop items the storage quarantined from the queue, the held groups and leases (emptied leases go)."""
        self.queue.forget(gids)
        self.observed.forget(gids)
        self.held.forget(gids)
        self.leases.forget(gids)

    def reset(self) -> None:
        """Forget everything: queue, held and leased items, registration, environments, step, published version."""
        with self._lock:
            self.storage.apply(Transaction(clear=True, meta=dict(RESET_META)))
            self.counters = Counters()
            self.observed = ServeObserver()
            self._restore(StoredState(items=[], meta=dict(RESET_META)))
            self._changed.notify_all()
