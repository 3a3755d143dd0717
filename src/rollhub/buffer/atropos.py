"""The Atropos buffer: the buffer table (:mod:`rollhub.buffer.table`) with AtroposLib's batch rule and an env registry.

:class:`ExperienceBuffer` adds to the table what AtroposLib 0.4.0's server does with environments: the registry
(:mod:`rollhub.buffer.envs`: ``/register-env``, ``/disconnect-env``, the ``/status-env`` arithmetic), scored
groups checked against it on ingest, groups smaller than their env's ``group_size`` held (:mod:`rollhub.buffer.held`)
until parts add up to a whole group, and batches formed by AtroposLib's packing with each env's minimum allocation
(:class:`rollhub.buffer.batching.PackingRule`). Staleness, admission, leases and storage are the table's.

All public methods are thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollhub.buffer.batching import PackingRule
from rollhub.buffer.envs import (
    CombineWork,
    EnvRecord,
    EnvRegistration,
    EnvRequest,
    EnvStatus,
    check_group,
    minimums,
    new_record,
    status_env,
    validate_register_env,
    why_unregistered,
)
from rollhub.buffer.held import HeldGroups
from rollhub.buffer.results import Ingested
from rollhub.buffer.storage import Entry, Storage, StoredState, Transaction
from rollhub.buffer.table import RESET_META, Admission, StalenessGate, Table
from rollhub.buffer.types import BufferConfig
from rollhub.errors import ItemsDamaged, UnknownEnv
from rollhub.experience import Group
from rollhub.experience.episodes import episode_count


class ExperienceBuffer(Table):
    """The table with AtroposLib's batch rule, the env registry, group ingest and held parts.

    Args:
        storage: where items and state are kept (see :func:`rollhub.buffer.backends.make_storage`).
        config: staleness and backpressure bounds, and ``stamp_unversioned``.
        staleness, admission: as for :class:`~rollhub.buffer.table.Table` (default: from ``config``).
        clock: wall-clock seconds, for lease deadlines and item ages.
    """

    reset_meta = {**RESET_META, "envs": []}

    last_combine: CombineWork | None = None
    """The cost of the latest search for held groups to combine (bounded; see ``envs.find_combination``)."""

    def __init__(
        self,
        storage: Storage,
        config: BufferConfig | None = None,
        *,
        staleness: StalenessGate | None = None,
        admission: Admission | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        rule = PackingRule(lambda: minimums(self.envs))
        super().__init__(storage, config, rule=rule, staleness=staleness, admission=admission, clock=clock)

    # ------------------------------------------------------------------ state
    def _restore(self, stored: StoredState) -> None:
        super()._restore(stored)
        self.envs = [EnvRecord(**e) for e in stored.meta.get("envs", [])]
        self.held = HeldGroups()
        for row in stored.items:
            if row.state == "held":
                self.held.hold(row.entry.env_id, row.entry)  # type: ignore[arg-type]

    def _save(self) -> tuple[Any, ...]:
        return super()._save(), self.held.snapshot()

    def _undo(self, saved: tuple[Any, ...]) -> None:
        table, held = saved
        super()._undo(table)
        self.held.rollback(held)

    def _waiting_elsewhere(self) -> int:
        return self.held.sequences()

    def _forget(self, gids: set[int]) -> None:
        super()._forget(gids)
        self.held.forget(gids)

    def held_sequences(self, env_id: int | None = None) -> int:
        """Sequences held until they make a whole group, in all or for one env."""
        with self._lock:
            return self.held.sequences(env_id)

    # ---------------------------------------------------------------- envs
    def register_env(self, req: EnvRequest) -> EnvRegistration:
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

    def _ingest_one(self, group: Group, env: EnvRecord | None, tx: Transaction) -> Ingested:
        if self.config.stamp_unversioned and group.policy_version is None:
            group.policy_version = self.staleness.reference(self.step)  # see BufferConfig.stamp_unversioned
            group.wire = None  # the client's encoding no longer describes the group
        self.counters.tokens_in += group.n_tokens
        units = episode_count(group)
        self._count_in(group.env_id, units)
        if env is None or units == env.group_size:
            self._enqueue(self._entry(group), group, tx)
            return Ingested()
        merged, self.last_combine = self.held.add_part(
            env, self._entry(group), group, tx, self._next_order(), self.storage.payloads
        )
        if merged is not None:
            self._enqueue(self._entry(merged), merged, tx)
        return Ingested(self.held.sequences(env.env_id))

    def _entry(self, group: Group) -> Entry:
        return Entry(next(self._gids), episode_count(group), group.env_id, group.policy_version, group.n_tokens)
