"""The experience buffer core: plain Python, no HTTP, no Ray; the server and the Ray actor both wrap it.

:class:`ExperienceBuffer` coordinates small parts, each with one job, and keeps the locking and the
transactions in one place:

* storage (:mod:`rollhub.buffer.storage`): payloads and a durable copy of everything below;
* the queue (:mod:`rollhub.buffer.queue`) and held parts (:mod:`rollhub.buffer.held`);
* the batch former (:class:`rollhub.buffer.batching.BatchFormer`);
* the staleness clock (:mod:`rollhub.buffer.staleness`, using :class:`rollhub.experience.StalenessPolicy`);
* admission (:mod:`rollhub.buffer.admission`): the queue bound and leases;
* the env registry (:mod:`rollhub.buffer.envs`).

Invariants (checked by the property tests):

* every accepted sequence is served at most once, and exactly once unless it went stale or was reset;
* every batch holds exactly ``batch_size`` sequences of whole groups;
* with ``max_staleness`` set, no item with ``policy_version < v - max_staleness`` is served, where ``v`` is the
  latest published policy version, or ``current_step`` before any publish;
* every change is written through the storage backend in one transaction before a call returns;
* a batch leaves the queue (or is leased) only after its answer was encoded (:meth:`ExperienceBuffer.serve_batch`);
  a failure puts it back whole, first in line.

All public methods are thread-safe.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from rollhub.buffer.batching import BatchFormer
from rollhub.buffer.envs import (
    CombineWork,
    EnvRecord,
    check_group,
    minimums,
    new_record,
    status_env,
    validate_register_env,
    why_unregistered,
)
from rollhub.buffer.results import BufferStatus, EnvRegistration, EnvStatus, Ingested, VersionPublished
from rollhub.buffer.state import BufferState
from rollhub.buffer.storage import Entry, Transaction
from rollhub.buffer.types import Batch, TrainerRun
from rollhub.errors import InvalidInput, ItemsDamaged, UnknownEnv
from rollhub.experience import Group
from rollhub.experience.episodes import episode_count
from rollhub.wire.models import RegisterEnv

T = TypeVar("T")


def _as_is(batch: Batch) -> Batch:
    return batch


class ExperienceBuffer(BufferState):
    """Trainer registration, the env registry, ingest, batch formation, staleness, leases and backpressure.

    Args:
        storage: where items and state are kept (see :func:`rollhub.buffer.make_storage`).
        config: staleness and backpressure bounds.
        clock: wall-clock seconds, for lease deadlines and item ages.
    """

    last_combine: CombineWork | None = None
    """The cost of the latest search for held groups to combine (bounded; see ``envs.find_combination``)."""

    # ------------------------------------------------------------- trainer
    def register_trainer(self, run: TrainerRun) -> int:
        """Configure the run and return a fresh uuid.

        The first call sets up the run and the step counter (``starting_step``). Later calls update the run
        parameters (batch size, W&B names, checkpoint info) but keep the queue, the environments and the step,
        so a restarted trainer loses nothing; ``reset()`` starts a new run.
        """
        if run.batch_size < 1:
            raise InvalidInput(f"batch_size is {run.batch_size}; it must be at least 1", field="batch_size")
        with self._lock:
            step = run.starting_step if self.run is None else self.step
            self.storage.apply(Transaction(meta={"run": run.to_json(), "step": step}))
            self.run, self.step = run, step
            self._uuids.append(uuid.uuid4().int)
            return self._uuids[-1]

    def mark_started(self) -> None:
        """The trainer asked for its first batch: environments may now register."""
        with self._lock:
            self._require_run()
            if not self.started:
                self.started = True
                self.storage.apply(Transaction(meta={"started": True}))

    def publish_version(self, version: int) -> VersionPublished:
        """The trainer now holds ``version`` (weight updates published): from now on the staleness bound compares
        against it, and items too stale for it are dropped at once.

        Raises:
            InvalidInput: ``version`` is not a whole number >= 0.
            VersionConflict: ``version`` is lower than the one already published.
        """
        with self._lock:
            version = self.staleness.check(version)
            before = self.staleness.published
            self.staleness.published = version
            try:
                with self._atomic():
                    tx = Transaction(meta={"policy_version": version})
                    dropped = self._drop_stale(tx)
                    self.storage.apply(tx)
            except BaseException:
                self.staleness.published = before
                raise
            return VersionPublished(version, dropped)

    def status(self) -> BufferStatus:
        """``current_step`` and ``queue_size`` (queued groups) as in 0.4.0, plus rollhub's queue figures."""
        with self._lock:
            self._expire_leases()
            return BufferStatus(
                current_step=self.step,
                queue_size=len(self.queue),
                queued_sequences=self.queue.sequences,
                held_sequences=self.held.sequences(),
                leased_batches=self.leases.active(),
                max_queued_sequences=self.config.max_queued_sequences,
                max_staleness=self.config.max_staleness,
                stale_dropped=dict(self.counters.stale_dropped),
                serve_failures=self.counters.serve_failures,
                storage=self.storage.stats(),
                policy_version=self.staleness.published,
            )

    def held_sequences(self, env_id: int | None = None) -> int:
        """Sequences held until they make a whole group, in all or for one env."""
        with self._lock:
            return self.held.sequences(env_id)

    # ---------------------------------------------------------------- envs
    def register_env(self, req: RegisterEnv) -> EnvRegistration:
        """Register a rollout handler; until the trainer's first batch request the answer is to wait."""
        validate_register_env(req)
        with self._lock:
            if self.run is None or not self.started:
                self.counters.env_registrations_waited += 1
                return EnvRegistration(None, None, self.step)
            record = new_record(self.envs, req)
            self.storage.apply(Transaction(meta={"envs": [e.to_json() for e in [*self.envs, record]]}))
            self.envs.append(record)
            return EnvRegistration(record, self.run, self.step)

    def disconnect_env(self, env_id: int) -> None:
        """Mark an env disconnected (its minimum allocation no longer applies; its id is never reused).

        Raises:
            UnknownEnv: ``env_id`` was never issued.
        """
        with self._lock:
            if not 0 <= env_id < len(self.envs):
                raise UnknownEnv(f"env_id {env_id} is not registered", field="env_id")
            self.envs[env_id].connected = False
            self.storage.apply(Transaction(meta={"envs": [e.to_json() for e in self.envs]}))

    def status_env(self, env_id: int) -> EnvStatus:
        """0.4.0's ``/status-env`` figures for ``env_id``."""
        with self._lock:
            run = self._require_run()
            why = why_unregistered(self.started, self.counters.env_registrations_waited)
            return status_env(self.envs, env_id, self.queue.by_env(), run.batch_size, self.step, why)

    def queued_by_env(self) -> dict[int | None, tuple[int, int]]:
        """``(groups, sequences)`` queued per env_id (only envs with something queued)."""
        with self._lock:
            return {k: (row.groups, row.sequences) for k, row in self.queue.by_env().items()}

    def queued(self) -> list[Entry]:
        """A snapshot of the queue metadata, oldest first (a copy of the whole queue: not for polling)."""
        with self._lock:
            return list(self.queue)

    # -------------------------------------------------------------- ingest
    def ingest(self, groups: list[Group]) -> list[Ingested]:
        """Store scored groups atomically (all or none); what became of each, in order.

        A group smaller than its env's ``group_size`` is held; when held groups of that env add up to
        exactly ``group_size`` they are merged into one queued group. With ``config.stamp_unversioned`` a group
        without a ``policy_version`` gets one on arrival (see :class:`BufferConfig`). A group of multi-turn episodes
        is sized by its episodes, not its rows (:func:`~rollhub.experience.episodes.episode_count`): a template that
        rewrote history gave some episode a second row, and the group is still one whole group of ``group_size``.

        Raises:
            InvalidInput: a group names an unknown env or is larger than its env's group size (nothing stored).
            QueueFull: the groups would take the waiting sequences past the bound (nothing stored).
        """
        with self._lock:
            why = why_unregistered(self.started, self.counters.env_registrations_waited)
            envs = [check_group(self.envs, g, why) for g in groups]  # every group is checked before any is stored
            self._admit(sum(episode_count(g) for g in groups))
            while True:
                try:
                    with self._atomic():
                        tx = Transaction()
                        results = [self._ingest_one(g, env, tx) for g, env in zip(groups, envs, strict=True)]
                        self.storage.apply(tx)
                    break
                except ItemsDamaged as exc:  # a held part was quarantined by storage: combine without it
                    self._forget(set(exc.gids))
            self._changed.notify_all()
            return results

    def _admit(self, incoming: int) -> None:
        try:
            self.bound.admit(self.queue.sequences + self.held.sequences(), incoming)
        except Exception:
            self.counters.refused_full += 1
            raise

    def _ingest_one(self, group: Group, env: EnvRecord | None, tx: Transaction) -> Ingested:
        if self.config.stamp_unversioned and group.policy_version is None:
            group.policy_version = self.staleness.reference(self.step)  # see BufferConfig.stamp_unversioned
            group.wire = None  # the client's encoding no longer describes the group
        self.counters.tokens_in += group.n_tokens
        units = episode_count(group)
        self._count_in(group.env_id, units)
        if env is None or units == env.group_size:
            self._enqueue(group, tx)
            return Ingested()
        merged, self.last_combine = self.held.add_part(
            env, self._entry(group), group, tx, self._next_order(), self.storage.payloads
        )
        if merged is not None:
            self._enqueue(merged, tx)
        return Ingested(self.held.sequences(env.env_id))

    def _count_in(self, env_id: int | None, size: int) -> None:
        self.counters.groups_in += 1
        self.counters.sequences_in += size
        self.counters.count_ingested(env_id, size)

    def _enqueue(self, group: Group, tx: Transaction) -> None:
        entry = self._entry(group)
        self.queue.append(entry)
        tx.put(entry, group, "queued", self._next_order())
        self.observed.queued(entry, self._clock())
        self._latest = group

    def add(self, payload: Any, *, size: int = 1, env_id: int | None = None, policy_version: int | None = None) -> None:
        """Queue an opaque item (e.g. a step-env fragment) counted as ``size`` sequences; no env checks."""
        if size < 1:
            raise InvalidInput(f"size is {size}; an item must count at least one sequence", field="size")
        with self._lock:
            self._admit(size)
            entry = Entry(next(self._gids), size, env_id, policy_version)
            self.storage.apply(Transaction(puts=[(entry, payload, "queued", self._next_order())]))
            self.queue.append(entry)
            self._count_in(env_id, size)
            self.observed.queued(entry, self._clock())
            self._latest = payload
            self._changed.notify_all()

    def latest_example(self) -> Any | None:
        """The last item queued (a merged group when parts were combined), or None."""
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

    def _former(self) -> BatchFormer:
        wanted = minimums(self.envs)
        return BatchFormer.with_minimums(wanted) if wanted else BatchFormer.packing()

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
        ``encode`` (or storing) raises, the whole batch stays where it was: queued groups keep their places at
        the head of the queue, an expired lease stays first in line, the step is not advanced, nothing is
        leased; ``counters.serve_failures`` counts the failure and the exception propagates. ``encode`` runs
        under the buffer lock, so it should only encode (no waiting).
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
                at_version = self.staleness.reference(self.step)  # what the staleness rule compares against
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
            former = self._former()
            attempt = (self.queue.changes, run.batch_size, former.rule)
            # a queue unchanged since an attempt that formed nothing forms nothing again: skip the walk
            picked = None if attempt == self._unformable else former.form(self.queue, run.batch_size)
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
