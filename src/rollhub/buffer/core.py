"""The experience buffer core: plain Python, no HTTP, no Ray; the server and the Ray actor both wrap it.

Invariants (checked by the property tests):

* every accepted sequence is served at most once, and exactly once unless it went stale or was reset;
* every batch holds exactly ``batch_size`` sequences of whole groups;
* with ``max_staleness`` set, no item with ``policy_version < current_step - max_staleness`` is served;
* every change is written through the storage backend in one transaction before a call returns;
* a batch leaves the queue (or is leased) only after its answer was encoded (:meth:`ExperienceBuffer.serve_batch`);
  a failure puts it back whole, first in line.

All public methods are thread-safe.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from rollhub.buffer import batching
from rollhub.buffer.envs import (
    CombineWork,
    EnvRecord,
    find_combination,
    minimums,
    new_record,
    status_env,
    validate_register_env,
)
from rollhub.buffer.observe import ServeObserver
from rollhub.buffer.storage import Entry, Storage, StoredState, Transaction
from rollhub.buffer.types import Batch, BufferConfig, Counters, Lease
from rollhub.errors import InvalidInput, ItemsDamaged, NotRegistered, QueueFull, UnknownBatch
from rollhub.experience import Group
from rollhub.wire.models import RegisterEnv, Registration

T = TypeVar("T")


def _as_is(batch: Batch) -> Batch:
    return batch


class ExperienceBuffer:
    """Trainer registration, the env registry, ingest, batch formation, staleness, leases and backpressure."""

    last_combine: CombineWork | None = None
    """The cost of the latest search for held groups to combine (bounded; see ``envs.find_combination``)."""

    def __init__(self, storage: Storage, config: BufferConfig | None = None, clock: Callable[[], float] = time.time):
        self.storage = storage
        self.config = config or BufferConfig()
        self._clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.counters = Counters()
        self.observed = ServeObserver()
        self._restore(storage.load())

    # ------------------------------------------------------------------ state
    def _restore(self, stored: StoredState) -> None:
        meta = stored.meta
        self.run: dict[str, Any] | None = meta.get("run")
        self.started: bool = bool(meta.get("started", False))
        self.step: int = int(meta.get("step", 0))
        self.envs = [EnvRecord(**e) for e in meta.get("envs", [])]
        self.counters.stale_dropped = dict(meta.get("stale", {}))
        self._uuids: list[int] = []
        self._queue: list[Entry] = []
        self._held: dict[int, list[Entry]] = {}
        self._leases: dict[str, Lease] = {}
        leases = meta.get("leases", {})
        for row in stored.items:
            if row.state == "queued":
                self._queue.append(row.entry)
            elif row.state == "held":
                self._held.setdefault(row.entry.env_id, []).append(row.entry)  # type: ignore[arg-type]
            else:
                info = leases.get(row.lease_id, {"step": self.step, "deadline": 0.0, "expired": True})
                lease = self._leases.setdefault(row.lease_id, Lease([], info["step"], info["deadline"]))  # type: ignore[arg-type]
                lease.expired = info["expired"]
                lease.entries.append(row.entry)
        self._gids = itertools.count(max((r.entry.gid for r in stored.items), default=0) + 1)
        self._back = max((r.order for r in stored.items), default=0.0) + 1.0
        self._front = min((r.order for r in stored.items), default=0.0) - 1.0
        self._latest: Any | None = None

    def _next_order(self) -> float:
        self._back += 1.0
        return self._back

    def _require_run(self) -> dict[str, Any]:
        if self.run is None:
            raise NotRegistered("no trainer is registered; the trainer must call POST /register first")
        return self.run

    @contextlib.contextmanager
    def _atomic(self) -> Iterator[None]:
        """Undo in-memory changes when storing them fails, so memory never disagrees with storage."""
        saved = (
            list(self._queue),
            {k: list(v) for k, v in self._held.items()},
            copy.copy(self._leases),
            {k: copy.copy(v) for k, v in self._leases.items()},
            self.step,
            copy.deepcopy(self.counters),
            self._latest,
        )
        try:
            yield
        except BaseException:
            queue, held, leases, lease_state, self.step, self.counters, self._latest = saved
            self._queue, self._held = queue, held
            self._leases = {k: lease_state[k] for k in leases}
            raise

    # ------------------------------------------------------------- trainer
    def register_trainer(self, reg: Registration) -> int:
        """Configure the run and return a fresh uuid.

        The first call sets up the run and the step counter (``starting_step``). Later calls update the run
        parameters (batch size, W&B names, checkpoint info) but keep the queue, the environments and the step,
        so a restarted trainer loses nothing; ``reset()`` starts a new run.
        """
        if reg.batch_size < 1:
            raise InvalidInput(f"batch_size is {reg.batch_size}; it must be at least 1", field="batch_size")
        with self._lock:
            tx = Transaction()
            if self.run is None:
                self.step = reg.starting_step
                tx.meta["step"] = self.step
            self.run = reg.model_dump()
            tx.meta["run"] = self.run
            self.storage.apply(tx)
            self._uuids.append(uuid.uuid4().int)
            return self._uuids[-1]

    def mark_started(self) -> None:
        """The trainer asked for its first batch: environments may now register."""
        with self._lock:
            self._require_run()
            if not self.started:
                self.started = True
                self.storage.apply(Transaction(meta={"started": True}))

    def wandb_info(self) -> dict[str, Any]:
        run = self.run or {}
        return {"group": run.get("wandb_group"), "project": run.get("wandb_project")}

    def info(self) -> dict[str, Any]:
        run = self.run or {}
        return {"batch_size": run.get("batch_size", -1), "max_token_len": run.get("max_token_len", -1)}

    def status(self) -> dict[str, Any]:
        """``current_step`` and ``queue_size`` (queued groups) as in 0.4.0, plus rollhub's queue figures."""
        with self._lock:
            self._expire_leases()
            return {
                "current_step": self.step,
                "queue_size": len(self._queue),
                "queued_sequences": sum(e.size for e in self._queue),
                "held_sequences": self.held_sequences(),
                "leased_batches": sum(1 for lease in self._leases.values() if not lease.expired),
                "max_queued_sequences": self.config.max_queued_sequences,
                "max_staleness": self.config.max_staleness,
                "stale_dropped": dict(self.counters.stale_dropped),
                "serve_failures": self.counters.serve_failures,
                "storage": self.storage.stats(),
            }

    def held_sequences(self, env_id: int | None = None) -> int:
        with self._lock:
            held = self._held.values() if env_id is None else [self._held.get(env_id, [])]
            return sum(e.size for entries in held for e in entries)

    # ---------------------------------------------------------------- envs
    def register_env(self, req: RegisterEnv) -> dict[str, Any]:
        """Register a rollout handler; until the trainer's first batch request the answer is to wait."""
        validate_register_env(req)
        with self._lock:
            if self.run is None or not self.started:
                return {"status": "wait for trainer to start"}
            record = new_record(self.envs, req)
            self.envs.append(record)
            self.storage.apply(Transaction(meta={"envs": [e.to_json() for e in self.envs]}))
            run = self.run
            return {
                "status": "success",
                "env_id": record.env_id,
                "wandb_name": record.wandb_name,
                "checkpoint_dir": run["checkpoint_dir"],
                "starting_step": self.step,
                "checkpoint_interval": run["save_checkpoint_interval"],
                "num_steps": run["num_steps"],
            }

    def disconnect_env(self, env_id: int) -> dict[str, Any]:
        with self._lock:
            if not 0 <= env_id < len(self.envs):
                return {"status": "failure", "error": f"env_id {env_id} is not registered"}
            self.envs[env_id].connected = False
            self.storage.apply(Transaction(meta={"envs": [e.to_json() for e in self.envs]}))
            return {"status": "success"}

    def status_env(self, env_id: int) -> dict[str, Any]:
        with self._lock:
            run = self._require_run()
            return status_env(self.envs, env_id, self._queue, run["batch_size"], self.step)

    # -------------------------------------------------------------- ingest
    def _check_env(self, group: Group) -> EnvRecord | None:
        if group.env_id is None:
            return None
        if not 0 <= group.env_id < len(self.envs):
            raise InvalidInput(
                f"env_id {group.env_id} is not registered ({len(self.envs)} envs known); "
                "use the env_id that /register-env returned, or leave it out",
                field="env_id",
            )
        env = self.envs[group.env_id]
        if group.size > env.group_size:
            raise InvalidInput(
                f"group has {group.size} sequences but env {env.env_id} registered "
                f"group_size {env.group_size}; "
                "send at most group_size sequences per group (smaller groups are combined)",
                field="tokens",
            )
        return env

    def _admit(self, incoming: int) -> None:
        bound = self.config.max_queued_sequences
        if bound is None:
            return
        waiting = sum(e.size for e in self._queue) + self.held_sequences()
        if waiting and waiting + incoming > bound:
            self.counters.refused_full += 1
            raise QueueFull(
                f"the queue holds {waiting} sequences and the bound is {bound}; retry after "
                f"{self.config.retry_after_s:g} s (nothing of this request was stored)",
                retry_after_s=self.config.retry_after_s,
            )

    def ingest(self, groups: list[Group]) -> list[dict[str, Any]]:
        """Store scored groups atomically (all or none); one 0.4.0-style result dict per group.

        A group smaller than its env's ``group_size`` is held; when held groups of that env add up to
        exactly ``group_size`` they are merged into one queued group.
        """
        with self._lock:
            envs = [self._check_env(g) for g in groups]  # every group is checked before any is stored
            self._admit(sum(g.size for g in groups))
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

    def _ingest_one(self, group: Group, env: EnvRecord | None, tx: Transaction) -> dict[str, Any]:
        c = self.counters
        c.groups_in += 1
        c.sequences_in += group.size
        c.tokens_in += group.n_tokens
        c.count_ingested(group.env_id, group.size)
        if env is None or group.size == env.group_size:
            self._enqueue(group, tx)
            return {"status": "received"}
        held = self._held.setdefault(env.env_id, [])
        entry = self._entry(group)
        held.append(entry)
        tx.put(entry, group, "held", self._next_order())
        self.last_combine = CombineWork()
        pick = find_combination([e.size for e in held], env.group_size, self.last_combine)
        if pick:
            picked = set(pick)
            parts = [held[i] for i in pick]
            payloads = [group if e is entry else self._held_payload(e, tx) for e in parts]
            self._held[env.env_id] = [e for i, e in enumerate(held) if i not in picked]
            tx.deletes.extend(e.gid for e in parts if e is not entry)
            tx.puts = [p for p in tx.puts if p[0] is not entry]
            self._enqueue(Group.merge(payloads), tx)
        return {"status": "buffered", "buffer_size": self.held_sequences(env.env_id)}

    def _held_payload(self, entry: Entry, tx: Transaction) -> Any:
        for put in tx.puts:  # held earlier in this same request
            if put[0] is entry:
                return put[1]
        return self.storage.payloads([entry.gid])[0]

    def _entry(self, group: Group) -> Entry:
        return Entry(next(self._gids), group.size, group.env_id, group.policy_version, group.n_tokens)

    def _enqueue(self, group: Group, tx: Transaction) -> None:
        entry = self._entry(group)
        self._queue.append(entry)
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
            self._queue.append(entry)
            self.counters.groups_in += 1
            self.counters.sequences_in += size
            self.counters.count_ingested(env_id, size)
            self.observed.queued(entry, self._clock())
            self._latest = payload
            self._changed.notify_all()

    def latest_example(self) -> Any | None:
        with self._lock:
            if self._latest is None and self._queue:
                self._latest = self.storage.payloads([self._queue[-1].gid])[0]
            return self._latest

    # --------------------------------------------------------------- serve
    def _expire_leases(self) -> None:
        now = self._clock()
        expired = {bid: lease for bid, lease in self._leases.items() if not lease.expired and lease.deadline < now}
        if expired:
            for lease in expired.values():
                lease.expired = True
            self.counters.lease_expiries += len(expired)
            self.storage.apply(Transaction(meta={"leases": self._leases_json()}))

    def _leases_json(self) -> dict[str, Any]:
        return {bid: lease.to_json() for bid, lease in self._leases.items()}

    def _drop_stale(self, tx: Transaction) -> None:
        limit = self.config.max_staleness
        if limit is None:
            return
        oldest_ok = self.step - limit
        keep = []
        for e in self._queue:
            if e.policy_version is not None and e.policy_version < oldest_ok:
                key = str(e.env_id)
                self.counters.stale_dropped[key] = self.counters.stale_dropped.get(key, 0) + 1
                tx.deletes.append(e.gid)
                self.observed.forget([e.gid])
            else:
                keep.append(e)
        if len(keep) != len(self._queue):
            self._queue = keep
            tx.meta["stale"] = dict(self.counters.stale_dropped)

    def _select(self, batch_size: int) -> list[int] | None:
        if any(e.min_batch_allocation is not None for e in self.envs):
            return batching.pack_with_minimums(self._queue, batch_size, minimums(self.envs))
        return batching.pack_heterogeneous(self._queue, batch_size)

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
                formed = False
                try:
                    with self._atomic():
                        at_step = self.step  # the step the staleness rule compares against
                        batch, tx = self._try_batch(lease_s)
                        if batch is not None:
                            formed = True
                            encoded = encode(batch)
                            self.storage.apply(tx)
                            self.observed.served(batch.entries, at_step, self._clock())
                            return encoded
                except Exception as exc:
                    if formed:  # counted after the rollback, which restores the counters
                        self.counters.serve_failures += 1
                        raise
                    if not isinstance(exc, ItemsDamaged):
                        raise
                    self._forget(set(exc.gids))  # quarantined by storage: forget them and form the batch again
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)

    def _try_batch(self, lease_s: float | None) -> tuple[Batch | None, Transaction]:
        """Form a batch in memory and return it with the transaction that commits it (not yet applied)."""
        run = self._require_run()
        tx = Transaction()
        redo = next((bid for bid, lease in self._leases.items() if lease.expired), None)
        if redo is not None:
            lease = self._leases.pop(redo)
            entries, step = lease.entries, lease.step
            self.counters.redelivered += 1
        else:
            self._drop_stale(tx)
            picked = self._select(run["batch_size"])
            if picked is None:
                self.storage.apply(tx)
                return None, tx
            chosen = set(picked)
            entries = [self._queue[i] for i in picked]
            self._queue = [e for i, e in enumerate(self._queue) if i not in chosen]
            step = self.step
            self.step += 1
            tx.meta["step"] = self.step
        gids = [e.gid for e in entries]
        batch = Batch(self.storage.payloads(gids), entries, step)
        if lease_s is not None:
            batch.batch_id = uuid.uuid4().hex
            batch.deadline = self._clock() + lease_s
            self._leases[batch.batch_id] = Lease(entries, step, batch.deadline)
            tx.move(gids, "leased", batch.batch_id)
        else:
            tx.deletes.extend(gids)
        tx.meta["leases"] = self._leases_json()
        self.counters.batches_out += 1
        self.counters.sequences_out += batch.sequences
        self.counters.count_served(entries)
        return batch, tx

    def _forget(self, gids: set[int]) -> None:
        """Drop items the storage quarantined from the queue, the held groups and leases (emptied leases go)."""
        self._queue = [e for e in self._queue if e.gid not in gids]
        self.observed.forget(gids)
        for env_id, held in self._held.items():
            self._held[env_id] = [e for e in held if e.gid not in gids]
        for bid, lease in list(self._leases.items()):
            lease.entries = [e for e in lease.entries if e.gid not in gids]
            if not lease.entries:
                del self._leases[bid]

    def ack(self, batch_id: str) -> None:
        """Confirm a leased batch was consumed: it is deleted and never served again."""
        with self._lock:
            lease = self._leases.get(batch_id)
            if lease is None:
                raise UnknownBatch(
                    f"batch {batch_id!r} is not leased: never issued, already acknowledged, "
                    "or expired and served again under a new id"
                )
            del self._leases[batch_id]
            self.storage.apply(
                Transaction(deletes=[e.gid for e in lease.entries], meta={"leases": self._leases_json()})
            )

    def queued(self) -> list[Entry]:
        """A snapshot of the queue metadata, oldest first."""
        with self._lock:
            return list(self._queue)

    def reset(self) -> None:
        """Forget everything: queue, held and leased items, registration, environments, step, latest."""
        with self._lock:
            meta = {"run": None, "started": False, "step": 0, "envs": [], "leases": {}, "stale": {}}
            self.storage.apply(Transaction(clear=True, meta=meta))
            self.counters = Counters()
            self.observed = ServeObserver()
            self._restore(StoredState(items=[], meta=meta))
            self._changed.notify_all()
