"""`FragmentColumns`: the records of one vector of environments, column by column, cut into `SampleFragment`s at
``fragment_length + 1`` records per environment.

A record is stored the way it arrives: record ``t`` of an environment holds the observation ``obs_t``, what the
policy did with it (action, behaviour log-prob, value estimate, policy version, episode id, recurrent state
before the step) and the reward and done flags of the transition *into* ``obs_t``. So a fragment of ``L`` steps
needs ``L + 1`` records: the extra record supplies the reward and done flags of the last transition and the
bootstrap observation/value, and then becomes record 0 of the next fragment (its incoming reward belongs to the
fragment already sent and is not counted twice).

Every field is one array of ``[L + 1, n_envs, ...]`` rows, so one step of the whole vector is one row write per
field instead of one Python object per environment. Environments normally hold the same number of records and
are written row by row; after a crash (an environment replaces its newest record instead of adding one) or a
partial reset they are written at their own positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from rollhub.errors import ConfigError
from rollhub.experience.fragment import SampleFragment

_SCALARS = {
    "logp": np.float32, "value": np.float32, "version": np.int64, "episode_id": np.int64,
    "reward_in": np.float32, "terminated_in": bool, "truncated_in": bool, "final_value_in": np.float32,
}  # fmt: skip


class Pending(NamedTuple):
    """An environment's newest record (its transition has not arrived yet)."""

    version: int
    value: float
    reward_in: float
    terminated_in: bool
    truncated_in: bool
    final_value_in: float


class FragmentColumns:
    """The records of ``len(env_indices)`` environments; :meth:`append` returns a :class:`SampleFragment` for
    every environment that reaches ``fragment_length + 1`` records.

    Guarantees: every record appended after a reset of an environment appears in exactly one fragment of that
    environment, in order; its fragments chain (the bootstrap observation of one is ``obs[0]`` of the next)
    unless it was reset in between.

    Args:
        fragment_length: steps per fragment (``L``).
        env_indices: the manager's index of each environment (copied into its fragments).
        worker_id, task: copied into every fragment.
    """

    def __init__(self, fragment_length: int, env_indices: Sequence[int], *, worker_id: str = "",
                 task: str = "") -> None:  # fmt: skip
        if fragment_length < 1:
            raise ConfigError(f"fragment_length must be >= 1, got {fragment_length}")
        self.fragment_length = fragment_length
        self.env_indices = list(env_indices)
        self.worker_id = worker_id
        self.task = task
        self.count = np.zeros(len(self.env_indices), np.int64)  # records held per environment
        self._columns = np.arange(len(self.env_indices))
        self._aligned = True  # every environment holds the same number of records
        self._cols: dict[str, np.ndarray] = {}
        self._floor: int | None = None  # the oldest version held (None: recompute)

    def held(self) -> list[int]:
        """Records held per environment (the pending one included)."""
        return self.count.tolist()

    def pending(self, j: int) -> Pending | None:
        """Environment ``j``'s newest record, if it holds any."""
        if self.count[j] == 0:
            return None
        t, c = int(self.count[j]) - 1, self._cols
        return Pending(int(c["version"][t, j]), float(c["value"][t, j]), float(c["reward_in"][t, j]),
                       bool(c["terminated_in"][t, j]), bool(c["truncated_in"][t, j]),
                       float(c["final_value_in"][t, j]))  # fmt: skip

    def drop_older_than(self, min_version: int) -> int:
        """Reset every environment holding a record chosen by a policy older than ``min_version``.

        Returns:
            The number of completed steps dropped (pending records not counted; 0 when nothing was stale).
        """
        if not self._cols:
            return 0
        if self._floor is None:
            held = self.count > 0
            self._floor = int(self._cols["version"][0][held].min()) if held.any() else min_version
        if self._floor >= min_version:
            return 0
        # versions only grow within an environment (weights load in order), so record 0 is its oldest
        stale = (self.count > 0) & (self._cols["version"][0] < min_version)
        dropped = int(np.maximum(self.count[stale] - 1, 0).sum())
        self.count[stale] = 0
        self._settle()
        return dropped

    def append(self, obs: np.ndarray, actions: np.ndarray, fields: dict[str, Any], states: np.ndarray | None = None,
               replace: Sequence[int] = ()) -> list[SampleFragment]:  # fmt: skip
        """Add one record per environment (row ``j`` of every array for environment ``j``).

        Args:
            obs, actions: ``[n, ...]``.
            fields: every name of ``logp, value, version, episode_id, reward_in, terminated_in, truncated_in,
                final_value_in``, each ``[n]`` or one scalar for all.
            states: the recurrent state before the step, ``[n, ...]`` (``None`` for feed-forward policies).
            replace: environments whose record replaces their newest one instead of following it (their
                environment crashed before answering it).
        """
        if not self._cols:
            self._allocate(obs, actions, states)
        if self._aligned and not replace:  # the common turn: one row of every column
            t = int(self.count[0])
            self._write(t, obs, actions, fields, states)
            if t == 0:  # a record 0 changed: the oldest version held may have too
                self._floor = None
            self.count += 1
            return self._cut_full() if t == self.fragment_length else []
        rows = self.count.copy()
        for j in replace:
            rows[j] = max(rows[j] - 1, 0)
        self._aligned = False
        self._write((rows, self._columns), obs, actions, fields, states)
        if (rows == 0).any():
            self._floor = None
        self.count = rows + 1
        out = self._cut_full()
        self._settle()
        return out

    def _write(self, where: Any, obs: np.ndarray, actions: np.ndarray, fields: dict[str, Any],
               states: np.ndarray | None) -> None:  # fmt: skip
        cols = self._cols
        cols["obs"][where] = obs
        cols["actions"][where] = actions
        if states is not None:
            cols["states"][where] = states
        for name, value in fields.items():
            cols[name][where] = value

    def _cut_full(self) -> list[SampleFragment]:
        """The fragments of every environment holding ``L + 1`` records; their record ``L`` becomes record 0."""
        full = np.flatnonzero(self.count > self.fragment_length).tolist()
        out = [self._cut(j) for j in full]
        if full:
            self._roll(full)
        return out

    def _allocate(self, obs: np.ndarray, actions: np.ndarray, states: np.ndarray | None) -> None:
        rows = (self.fragment_length + 1, len(self.env_indices))
        self._cols = {name: np.zeros(rows, dtype) for name, dtype in _SCALARS.items()}
        self._cols["obs"] = np.zeros(rows + obs.shape[1:], obs.dtype)
        self._cols["actions"] = np.zeros(rows + actions.shape[1:], actions.dtype)
        if states is not None:
            self._cols["states"] = np.zeros(rows + states.shape[1:], states.dtype)

    def _cut(self, j: int) -> SampleFragment:
        """Environment ``j``'s fragment from its records ``0 .. L``."""
        c, L = self._cols, self.fragment_length
        states = c.get("states")
        return SampleFragment(
            obs=c["obs"][:L, j].copy(),
            actions=c["actions"][:L, j].copy(),
            rewards=c["reward_in"][1:, j].copy(),
            terminated=c["terminated_in"][1:, j].copy(),
            truncated=c["truncated_in"][1:, j].copy(),
            logp=c["logp"][:L, j].copy(),
            values=c["value"][:L, j].copy(),
            final_values=c["final_value_in"][1:, j].copy(),
            bootstrap_obs=c["obs"][L, j].copy(),
            bootstrap_value=float(c["value"][L, j]),
            state_in=None if states is None else states[0, j].copy(),
            versions=c["version"][:L, j].copy(),
            episode_ids=c["episode_id"][:L, j].copy(),
            worker_id=self.worker_id,
            env_index=self.env_indices[j],
            task=self.task,
        )

    def _roll(self, cut: list[int]) -> None:
        """Record ``L`` of every environment in ``cut`` becomes its record 0."""
        L = self.fragment_length
        index: Any = slice(None) if len(cut) == len(self.count) else cut
        for array in self._cols.values():
            array[0, index] = array[L, index]
        self.count[index] = 1
        self._floor = None

    def _settle(self) -> None:
        """Row writes again once every environment holds the same number of records."""
        self._aligned = bool((self.count == self.count[0]).all())
        self._floor = None
