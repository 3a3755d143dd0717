"""`SampleFragment`s and the per-environment buffer that cuts them at ``fragment_length + 1`` steps.

A step record is stored the way it arrives: record ``t`` holds the observation ``obs_t``, what the policy did
with it (action, behaviour log-prob, value estimate, policy version, recurrent state before the step) and the
reward and done flags of the transition *into* ``obs_t``. So a fragment of ``L`` steps needs ``L + 1``
records: the extra record supplies the reward and done flags of the last transition and the bootstrap
observation/value, and then becomes record 0 of the next fragment (its incoming reward belongs to the
fragment already sent and is not counted twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rollhub.errors import ConfigError
from rollhub.experience.fragment import SampleFragment


@dataclass(slots=True)
class StepRecord:
    """One observation as it arrives, plus what the policy did with it (see the module docstring)."""

    obs: Any
    action: Any
    logp: float
    value: float
    version: int
    episode_id: int
    state: np.ndarray | None
    reward_in: float = 0.0
    terminated_in: bool = False
    truncated_in: bool = False
    final_value_in: float = 0.0


class FragmentBuffer:
    """The per-environment buffer: append records, get a :class:`SampleFragment` every ``fragment_length``.

    Guarantees: every step appended after a reset of this buffer appears in exactly one fragment, in order;
    fragments of one environment chain (the bootstrap observation of one is ``obs[0]`` of the next) unless
    the buffer was reset in between.
    """

    def __init__(self, fragment_length: int, *, worker_id: str = "", env_index: int = 0, task: str = "") -> None:
        if fragment_length < 1:
            raise ConfigError(f"fragment_length must be >= 1, got {fragment_length}")
        self.fragment_length = fragment_length
        self.worker_id = worker_id
        self.env_index = env_index
        self.task = task
        self._records: list[StepRecord] = []

    def __len__(self) -> int:
        return len(self._records)

    @property
    def pending(self) -> StepRecord | None:
        """The newest record (its transition has not arrived yet), if any."""
        return self._records[-1] if self._records else None

    def append(self, record: StepRecord) -> SampleFragment | None:
        """Add the next record; return a fragment when ``fragment_length + 1`` records are held."""
        self._records.append(record)
        if len(self._records) <= self.fragment_length:
            return None
        fragment = self._cut()
        self._records = self._records[-1:]
        return fragment

    def replace_pending(self, record: StepRecord) -> None:
        """Replace the newest record (used when its environment crashed before answering)."""
        if self._records:
            self._records[-1] = record
        else:
            self._records.append(record)

    def reset(self) -> int:
        """Drop every record; return how many steps were thrown away (not counting the pending one)."""
        dropped = max(len(self._records) - 1, 0)
        self._records = []
        return dropped

    def drop_if_older_than(self, min_version: int) -> int:
        """Reset the buffer when any record was chosen by a policy older than ``min_version``.

        Returns:
            The number of completed steps dropped (0 when nothing was stale).
        """
        # versions only grow within a buffer (weights are loaded in order), so records[0] is the oldest
        if self._records and min(self._records[0].version, self._records[-1].version) < min_version:
            return self.reset()
        return 0

    def _cut(self) -> SampleFragment:
        steps = self._records[: self.fragment_length]
        nxt = self._records[1 : self.fragment_length + 1]
        state_in = steps[0].state
        return SampleFragment(
            obs=np.stack([np.asarray(r.obs) for r in steps]),
            actions=np.stack([np.asarray(r.action) for r in steps]),
            rewards=np.array([r.reward_in for r in nxt], dtype=np.float32),
            terminated=np.array([r.terminated_in for r in nxt], dtype=bool),
            truncated=np.array([r.truncated_in for r in nxt], dtype=bool),
            logp=np.array([r.logp for r in steps], dtype=np.float32),
            values=np.array([r.value for r in steps], dtype=np.float32),
            final_values=np.array([r.final_value_in for r in nxt], dtype=np.float32),
            bootstrap_obs=np.asarray(nxt[-1].obs),
            bootstrap_value=float(nxt[-1].value),
            state_in=None if state_in is None else np.array(state_in, copy=True),
            versions=np.array([r.version for r in steps], dtype=np.int64),
            episode_ids=np.array([r.episode_id for r in steps], dtype=np.int64),
            worker_id=self.worker_id,
            env_index=self.env_index,
            task=self.task,
        )
