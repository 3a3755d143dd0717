"""Held groups: parts smaller than their env's ``group_size``, kept per env until some add up to a whole group.

Which parts combine is :func:`rollhub.buffer.envs.find_combination`'s choice; this module only keeps them, with a
running count of held sequences so the queue bound and ``/status`` never walk them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rollhub.buffer.envs import CombineWork, EnvRecord, find_combination
from rollhub.buffer.storage import Entry, Transaction
from rollhub.experience import Group


class HeldGroups:
    """Held entries per env, in arrival order."""

    def __init__(self) -> None:
        self._held: dict[int, list[Entry]] = {}
        self._sequences = 0

    def sequences(self, env_id: int | None = None) -> int:
        """Sequences held, in all or for one env."""
        if env_id is None:
            return self._sequences
        return sum(e.size for e in self._held.get(env_id, []))

    def of(self, env_id: int) -> list[Entry]:
        """The held entries of ``env_id``, oldest first (do not modify)."""
        return self._held.get(env_id, [])

    def hold(self, env_id: int, entry: Entry) -> None:
        self._held.setdefault(env_id, []).append(entry)
        self._sequences += entry.size

    def add_part(
        self,
        env: EnvRecord,
        entry: Entry,
        group: Group,
        tx: Transaction,
        order: float,
        payloads: Callable[[Sequence[int]], list[Any]],
    ) -> tuple[Group | None, CombineWork]:
        """Hold a part of ``env`` (stored by ``tx``); if held parts now add up to ``group_size``, take them out and
        return them merged into one group (``tx`` deletes the parts), with what the search for them cost.

        ``payloads`` reads parts held by earlier requests back from storage.
        """
        self.hold(env.env_id, entry)
        tx.put(entry, group, "held", order)
        work = CombineWork()
        pick = find_combination([e.size for e in self.of(env.env_id)], env.group_size, work)
        if not pick:
            return None, work
        parts = self.take(env.env_id, pick)
        pending = {id(put[0]): put[1] for put in tx.puts}  # parts held earlier in this same request
        merged = Group.merge([pending[id(e)] if id(e) in pending else payloads([e.gid])[0] for e in parts])
        tx.deletes.extend(e.gid for e in parts if id(e) not in pending)
        tx.puts = [p for p in tx.puts if not any(p[0] is e for e in parts)]
        return merged, work

    def take(self, env_id: int, picked: list[int]) -> list[Entry]:
        """Remove and return the held entries of ``env_id`` at the ``picked`` positions."""
        held = self._held[env_id]
        chosen = set(picked)
        taken = [held[i] for i in picked]
        self._held[env_id] = [e for i, e in enumerate(held) if i not in chosen]
        self._sequences -= sum(e.size for e in taken)
        return taken

    def forget(self, gids: set[int]) -> None:
        """Drop entries storage quarantined."""
        for env_id, held in self._held.items():
            kept = [e for e in held if e.gid not in gids]
            self._sequences -= sum(e.size for e in held) - sum(e.size for e in kept)
            self._held[env_id] = kept

    def snapshot(self) -> tuple[dict[int, list[Entry]], int]:
        """What :meth:`rollback` needs (short lists: parts of not yet whole groups)."""
        return {k: list(v) for k, v in self._held.items()}, self._sequences

    def rollback(self, snapshot: tuple[dict[int, list[Entry]], int]) -> None:
        held, sequences = snapshot
        self._held, self._sequences = {k: list(v) for k, v in held.items()}, sequences
