"""The buffer table: items in, batches out, every change stored in one transaction. Plain Python, no HTTP, no Ray.

A :class:`Table` keeps queued items (their metadata in memory, their payloads in storage), serves them as batches
of exactly ``batch_size`` sequences, and holds served batches under leases until acknowledged. What varies
between the buffers built on it is injected, each part with one job:

* ``storage`` (:class:`~rollhub.buffer.storage.Storage`, with the payload codec its builder chose): payloads and a
  durable copy of everything below;
* the batch rule (:class:`BatchRule`): which queued items make the next batch;
* the staleness gate (:class:`StalenessGate`): which trainer version items are compared against, and which are
  too old to serve;
* admission (:class:`Admission`): whether new items may join the waiting ones.

The Atropos buffer (:class:`rollhub.buffer.atropos.ExperienceBuffer`) is this table with AtroposLib's batch rule
and an environment registry; the PPO replay buffer (:class:`rollhub.rollout.replay.ReplayBuffer`) is this table
with the fragment rule (:class:`rollhub.buffer.batching.FragmentRule`).

Invariants (checked by the property tests):

* every accepted sequence is served at most once, and exactly once unless it went stale or was reset;
* every batch holds exactly ``batch_size`` sequences of whole items;
* with ``max_staleness`` set, no item with ``policy_version < v - max_staleness`` is served, where ``v`` is the
  latest published policy version, or ``current_step`` before any publish;
* every change is written through the storage backend in one transaction before a call returns;
* a batch leaves the queue (or is leased) only after its answer was encoded (:meth:`Table.serve_batch`);
  a failure puts it back whole, first in line.

All public methods are thread-safe.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol, TypeVar

from rollhub.buffer.admission import Leases, QueueBound
from rollhub.buffer.batching import PackingRule
from rollhub.buffer.observe import ServeObserver
from rollhub.buffer.queue import Queue
from rollhub.buffer.results import BufferStatus, VersionPublished
from rollhub.buffer.staleness import StalenessClock
from rollhub.buffer.storage import Entry, Storage, StoredState, Transaction
from rollhub.buffer.types import Batch, BufferConfig, Counters, TrainerRun
from rollhub.errors import InvalidInput, ItemsDamaged, NotRegistered
from rollhub.experience import StalenessPolicy

T = TypeVar("T")


class BatchRule(Protocol):
    """Which queued items make the next batch."""

    def key(self) -> Hashable:
        """The rule as a comparable value: an unchanged queue under an equal key forms the same batch (or none)."""
        ...

    def form(self, queue: Queue, batch_size: int) -> list[Entry] | None:
        """The entries of the next batch of exactly ``batch_size`` sequences, or None; never changes ``queue``."""
        ...


class StalenessGate(Protocol):
    """The version items are compared against, and which items are too old to serve.

    ``published`` is the latest version the trainer published (None before the first) and ``published_step`` the
    table's step when it was; the table persists both.
    """

    published: int | None
    published_step: int

    def reference(self, step: int) -> int:
        """The trainer version items are compared against when the table has served ``step`` batches."""
        ...

    def next_batch_version(self, step: int) -> int | None:
        """The version the trainer will train the next batch at, the table having served ``step`` batches."""
        ...

    def check(self, version: object) -> int:
        """``version`` as a new published version, or raise without changing anything."""
        ...

    def drop_stale(self, queue: Queue, step: int) -> list[Entry]:
        """Take every item too stale to serve off ``queue`` and return them."""
        ...


class Admission(Protocol):
    """Whether new items may join the waiting ones."""

    retry_after_s: float

    def admit(self, waiting: int, incoming: int) -> None:
        """Allow ``incoming`` more sequences beside ``waiting`` ones, or raise (nothing of the request is stored)."""
        ...


def _as_is(batch: Batch) -> Batch:
    return batch


RESET_META: dict[str, Any] = {
    "run": None,
    "started": False,
    "step": 0,
    "leases": {},
    "stale": {},
    "policy_version": None,
    "published_step": 0,
}


class Table:
    """Queued items served as batches, with leases, a staleness gate and admission; see the module docstring.

    Args:
        storage: where items and state are kept (see :func:`rollhub.buffer.backends.make_storage`).
        config: staleness and backpressure bounds (used for the default gate and admission, and reported).
        rule: the batch rule (default: AtroposLib's packing, :class:`~rollhub.buffer.batching.PackingRule`).
        staleness: the staleness gate (default: :class:`~rollhub.buffer.staleness.StalenessClock` with
            ``config.max_staleness``).
        admission: the bound on waiting sequences (default: :class:`~rollhub.buffer.admission.QueueBound` with
            ``config.max_queued_sequences`` and ``config.retry_after_s``).
        clock: wall-clock seconds, for lease deadlines and item ages.
    """

    reset_meta: dict[str, Any] = RESET_META
    """The stored state of an empty table (what :meth:`reset` writes)."""

    def __init__(
        self,
        storage: Storage,
        config: BufferConfig | None = None,
        *,
        rule: BatchRule | None = None,
        staleness: StalenessGate | None = None,
        admission: Admission | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.storage = storage
        self.config = config or BufferConfig()
        self.rule: BatchRule = rule if rule is not None else PackingRule()
        self.staleness: StalenessGate = (
            staleness if staleness is not None else StalenessClock(StalenessPolicy(self.config.max_staleness))
        )
        self.bound: Admission = (
            admission
            if admission is not None
            else QueueBound(self.config.max_queued_sequences, self.config.retry_after_s)
        )
        self._clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.counters = Counters()
        self.observed = ServeObserver()
        self._restore(storage.load())

    # ------------------------------------------------------------------ state
    def _restore(self, stored: StoredState) -> None:
        """Rebuild the parts from what storage holds (rows in states other than queued and leased are a
        subclass's: see :meth:`ExperienceBuffer._restore`)."""
        meta = stored.meta
        run = meta.get("run")
        self.run: TrainerRun | None = None if run is None else TrainerRun(**run)
        self.started: bool = bool(meta.get("started", False))
        self.step: int = int(meta.get("step", 0))
        self.staleness.published = meta.get("policy_version")
        self.staleness.published_step = int(meta.get("published_step", self.step))
        self.counters.stale_dropped = dict(meta.get("stale", {}))
        self._uuids: list[int] = []
        self.queue = Queue(row.entry for row in stored.items if row.state == "queued")
        self.leases = Leases()
        for row in stored.items:
            if row.state == "leased":
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

    def _save(self) -> tuple[Any, ...]:
        """What :meth:`_undo` needs to return the small parts to this moment (the queue journals instead)."""
        return self.leases.snapshot(), self.step, self.counters.copy(), self._latest

    def _undo(self, saved: tuple[Any, ...]) -> None:
        leases, self.step, self.counters, self._latest = saved
        self.leases.rollback(leases)

    @contextlib.contextmanager
    def _atomic(self) -> Iterator[None]:
        """Undo in-memory changes when storing them fails, so memory never disagrees with storage."""
        saved = self._save()
        self.queue.begin()
        try:
            yield
        except BaseException:
            self.queue.rollback()
            self._undo(saved)
            raise
        self.queue.commit()

    def _waiting_elsewhere(self) -> int:
        """Sequences accepted but not queued (counted by admission and ``/status``); the table keeps none."""
        return 0

    def _forget(self, gids: set[int]) -> None:
        """Drop items the storage quarantined from the queue and leases (emptied leases go)."""
        self.queue.forget(gids)
        self.observed.forget(gids)
        self.leases.forget(gids)

    def reset(self) -> None:
        """Forget everything: queued and leased items, registration, step, published version."""
        with self._lock:
            meta = dict(self.reset_meta)
            self.storage.apply(Transaction(clear=True, meta=dict(meta)))
            self.counters = Counters()
            self.observed = ServeObserver()
            self._restore(StoredState(items=[], meta=meta))
            self._changed.notify_all()

    # ------------------------------------------------------------- trainer
    def register_trainer(self, run: TrainerRun) -> int:
        """Configure the run and return a fresh uuid.

        The first call sets up the run and the step counter (``starting_step``). Later calls update the run
        parameters but keep the queue and the step, so a restarted trainer loses nothing; ``reset()`` starts a
        new run.
        """
        if run.batch_size < 1:
            raise InvalidInput(f"batch_size is {run.batch_size}; it must be at least 1", field="batch_size")
        with self._lock:
            first = self.run is None
            step = run.starting_step if first else self.step
            meta: dict[str, Any] = {"run": run.to_json(), "step": step}
            if first:  # nothing of this run was served since a version was published
                meta["published_step"] = step
            self.storage.apply(Transaction(meta=meta))
            self.run, self.step = run, step
            if first:
                self.staleness.published_step = step
            self._uuids.append(uuid.uuid4().int)
            return self._uuids[-1]

    def mark_started(self) -> None:
        """The trainer asked for its first batch (from then on environments may register with the Atropos buffer)."""
        with self._lock:
            self._require_run()
            if not self.started:
                self.started = True
                self.storage.apply(Transaction(meta={"started": True}))

    def publish_version(self, version: int) -> VersionPublished:
        """The trainer now holds ``version`` (weight updates published): from now on the staleness gate compares
        against it, and items too stale for it are dropped at once.

        Raises:
            InvalidInput: ``version`` is not a whole number >= 0.
            VersionConflict: ``version`` is lower than the one already published.
        """
        with self._lock:
            version = self.staleness.check(version)
            before = self.staleness.published, self.staleness.published_step
            self.staleness.published, self.staleness.published_step = version, self.step
            try:
                with self._atomic():
                    tx = Transaction(meta={"policy_version": version, "published_step": self.step})
                    dropped = self._drop_stale(tx)
                    self.storage.apply(tx)
            except BaseException:
                self.staleness.published, self.staleness.published_step = before
                raise
            return VersionPublished(version, dropped)

    def status(self) -> BufferStatus:
        """``current_step`` and ``queue_size`` (queued items) as in AtroposLib 0.4.0, plus the queue figures."""
        with self._lock:
            self._expire_leases()
            return BufferStatus(
                current_step=self.step,
                queue_size=len(self.queue),
                queued_sequences=self.queue.sequences,
                held_sequences=self._waiting_elsewhere(),
                leased_batches=self.leases.active(),
                max_queued_sequences=self.config.max_queued_sequences,
                max_staleness=self.config.max_staleness,
                stale_dropped=dict(self.counters.stale_dropped),
                serve_failures=self.counters.serve_failures,
                storage=self.storage.stats(),
                policy_version=self.staleness.published,
                next_batch_version=self.staleness.next_batch_version(self.step),
            )

    def queued(self) -> list[Entry]:
        """A snapshot of the queue metadata, oldest first (a copy of the whole queue: not for polling)."""
        with self._lock:
            return list(self.queue)

    # -------------------------------------------------------------- ingest
    def _admit(self, incoming: int) -> None:
        try:
            self.bound.admit(self.queue.sequences + self._waiting_elsewhere(), incoming)
        except Exception:
            self.counters.refused_full += 1
            raise

    def _count_in(self, env_id: int | None, size: int) -> None:
        self.counters.groups_in += 1
        self.counters.sequences_in += size
        self.counters.count_ingested(env_id, size)

    def _enqueue(self, entry: Entry, payload: Any, tx: Transaction) -> None:
        self.queue.append(entry)
        tx.put(entry, payload, "queued", self._next_order())
        self.observed.queued(entry, self._clock())
        self._latest = payload

    def put(self, payload: Any, *, size: int = 1, env_id: int | None = None, policy_version: int | None = None) -> None:
        """Queue one item counted as ``size`` sequences (the table checks nothing of the payload itself).

        Raises:
            InvalidInput: ``size`` is below 1.
            QueueFull: admission refused it (nothing stored).
        """
        if size < 1:
            raise InvalidInput(f"size is {size}; an item must count at least one sequence", field="size")
        with self._lock:
            self._admit(size)
            entry = Entry(next(self._gids), size, env_id, policy_version)
            self.storage.apply(Transaction(puts=[(entry, payload, "queued", self._next_order())]))
            self.queue.append(entry)  # stored first: nothing to undo if storing fails
            self._count_in(env_id, size)
            self.observed.queued(entry, self._clock())
            self._latest = payload
            self._changed.notify_all()

    def latest_example(self) -> Any | None:
        """The last item queued (in the Atropos buffer, a merged group when parts were combined), or None."""
        with self._lock:
            last = self.queue.last()
            if self._latest is None and last is not None:
                self._latest = self.storage.payloads([last.gid])[0]
            return self._latest

    # --------------------------------------------------------------- serve
    def _expire_leases(self) -> None:
        expired = self.leases.expire(self._clock())
        if expired:
            self.counters.lease_expiries += expired
            self.storage.apply(Transaction(meta={"leases": self.leases.to_json()}))

    def _drop_stale(self, tx: Transaction) -> int:
        dropped = self.staleness.drop_stale(self.queue, self.step)
        if dropped:
            self.counters.count_stale(dropped)
            tx.deletes.extend(e.gid for e in dropped)
            self.observed.forget(e.gid for e in dropped)
            tx.meta["stale"] = dict(self.counters.stale_dropped)
        return len(dropped)

    def next_batch(self, lease_s: float | None = None, wait_s: float = 0.0) -> Batch | None:
        """Form and serve the oldest batch, or None; ``wait_s`` blocks this thread until one can be formed.

        With ``lease_s`` the batch stays stored until :meth:`ack`; unacknowledged after ``lease_s`` seconds it
        is served again, whole and before anything else, counting as the same step. A caller that still has
        to encode or send the batch should use :meth:`serve_batch`, so a failure there loses nothing.
        """
        return self.serve_batch(_as_is, lease_s, wait_s)

    def serve_batch(self, encode: Callable[[Batch], T], lease_s: float | None = None, wait_s: float = 0.0) -> T | None:
        """Form the next batch, ``encode`` it, and only then commit it as served (or leased); None if none forms.

        The batch leaves the queue only once ``encode(batch)`` has returned and the change is stored. If
        ``encode`` (or storing) raises, the whole batch stays where it was: queued items keep their places at
        the head of the queue, an expired lease stays first in line, the step is not advanced, nothing is
        leased; ``counters.serve_failures`` counts the failure and the exception propagates. ``encode`` runs
        under the table lock, so it should only encode (no waiting).
        """
        if lease_s is not None and not (0 < lease_s < 1e9):
            raise InvalidInput(f"lease_s is {lease_s}; it must be a finite number of seconds > 0", field="lease_s")
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                self._expire_leases()
                try:
                    served, encoded = self._serve_once(encode, lease_s)
                except ItemsDamaged as exc:  # quarantined by storage: forget them and form the batch again
                    self._forget(set(exc.gids))
                    continue
                if served:
                    return encoded
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)

    def _serve_once(self, encode: Callable[[Batch], T], lease_s: float | None) -> tuple[bool, T | None]:
        """One attempt: ``(True, encoded)`` when a batch was served, ``(False, None)`` when none could form.

        Raises:
            ItemsDamaged: storage quarantined items of the batch before it formed (nothing changed).
        """
        formed = False
        try:
            with self._atomic():
                at_version = self.staleness.reference(self.step)  # what the staleness gate compares against
                batch, tx = self._try_batch(lease_s)
                if batch is None:
                    return False, None
                formed = True
                encoded = encode(batch)
                self.storage.apply(tx)
                self.observed.served(batch.entries, at_version, self._clock())
                return True, encoded
        except Exception:
            if formed:  # counted after the rollback, which restores the counters
                self.counters.serve_failures += 1
            raise

    def _try_batch(self, lease_s: float | None) -> tuple[Batch | None, Transaction]:
        """Form a batch in memory and return it with the transaction that commits it (not yet applied)."""
        run = self._require_run()
        tx = Transaction()
        redo = self.leases.take_expired()
        if redo is not None:
            entries, step = redo.entries, redo.step
            self.counters.redelivered += 1
        else:
            self._drop_stale(tx)
            attempt = (self.queue.changes, run.batch_size, self.rule.key())
            # a queue unchanged since an attempt that formed nothing forms nothing again: skip the walk
            picked = None if attempt == self._unformable else self.rule.form(self.queue, run.batch_size)
            if picked is None:
                self._unformable = attempt
                self.storage.apply(tx)
                return None, tx
            entries = picked
            self.queue.remove(entries)
            step = self.step
            self.step += 1
            tx.meta["step"] = self.step
        gids = [e.gid for e in entries]
        batch = Batch(self.storage.payloads(gids), entries, step)
        if lease_s is not None:
            batch.deadline = self._clock() + lease_s
            batch.batch_id = self.leases.grant(entries, step, batch.deadline)
            tx.move(gids, "leased", batch.batch_id)
        else:
            tx.deletes.extend(gids)
        tx.meta["leases"] = self.leases.to_json()
        self.counters.batches_out += 1
        self.counters.sequences_out += batch.sequences
        self.counters.count_served(entries)
        return batch, tx

    def ack(self, batch_id: str) -> None:
        """Confirm a leased batch was consumed: it is deleted and never served again.

        Raises:
            UnknownBatch: ``batch_id`` is not leased (never issued, acknowledged, or expired and served again).
        """
        with self._lock:
            snapshot = self.leases.snapshot()
            lease = self.leases.release(batch_id)
            try:
                self.storage.apply(
                    Transaction(deletes=[e.gid for e in lease.entries], meta={"leases": self.leases.to_json()})
                )
            except BaseException:
                self.leases.rollback(snapshot)
                raise
