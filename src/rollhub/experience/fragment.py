"""The step fragment: ``L`` consecutive steps of one environment, the unit a step-environment learner trains on.

Cut by :class:`rollhub.rollout.step.fragments.FragmentColumns` at ``fragment_length + 1`` records, so the last
transition's reward and the bootstrap observation are known when the fragment leaves its worker.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SampleFragment:
    """``length`` consecutive steps of one environment, ready for an actor-critic learner.

    Index ``t`` describes the transition ``obs[t] --actions[t]--> next observation`` with ``rewards[t]``.
    ``terminated[t]``: the next state is terminal (no bootstrap). ``truncated[t]``: the episode was cut after
    step ``t`` (time limit, crash or restart); its value continues with ``final_values[t]``, the behaviour
    critic's estimate of the episode's last observation. Where neither flag is set, the next observation is
    ``obs[t + 1]``, or ``bootstrap_obs`` (value ``bootstrap_value``) after the last step.

    Attributes:
        obs: observations, shape ``[L, *obs_shape]``.
        actions: actions taken, shape ``[L, *action_shape]``.
        rewards: float32 ``[L]``.
        terminated: bool ``[L]``.
        truncated: bool ``[L]``.
        logp: behaviour log-probabilities of ``actions``, float32 ``[L]``.
        values: behaviour value estimates of ``obs``, float32 ``[L]``.
        final_values: value estimate of the final observation where ``truncated``, else 0; float32 ``[L]``.
        bootstrap_obs: the observation after the last step.
        bootstrap_value: the behaviour value estimate of ``bootstrap_obs``.
        state_in: the policy's recurrent state before step 0 (``None`` for feed-forward policies).
        versions: the policy version that chose each action, int64 ``[L]``.
        episode_ids: the episode each step belongs to (unique per worker and env), int64 ``[L]``.
        worker_id: the RolloutWorker that produced it.
        env_index: the environment slot inside that worker.
        task: the environment's task label.
        created_at: UNIX time of assembly.
    """

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    logp: np.ndarray
    values: np.ndarray
    final_values: np.ndarray
    bootstrap_obs: np.ndarray
    bootstrap_value: float
    state_in: np.ndarray | None
    versions: np.ndarray
    episode_ids: np.ndarray
    worker_id: str = ""
    env_index: int = 0
    task: str = ""
    created_at: float = field(default_factory=time.time)

    @property
    def length(self) -> int:
        """Number of steps (``L``)."""
        return int(self.rewards.shape[0])

    @property
    def min_version(self) -> int:
        """The oldest policy version in the fragment; its staleness is measured from this."""
        return int(self.versions.min())

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle every array as one contiguous byte string (a fragment crosses processes twice on its way to the
        trainer; a dozen small arrays pickled one by one cost several times more). Arrays of Python objects
        take the ordinary path."""
        arrays = [getattr(self, name) for name in _ARRAYS]
        if self.state_in is not None:
            arrays.append(self.state_in)
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if any(a.dtype.hasobject for a in arrays):
            fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            return (_from_fields, (fields,))
        layout = tuple((_dtype_name(a.dtype), a.shape) for a in arrays)
        payload = b"".join(a.tobytes() for a in arrays)
        scalars = (self.bootstrap_value, self.worker_id, self.env_index, self.task, self.created_at)
        return (_unpack, (layout, payload, scalars))


_ARRAYS = ("obs", "actions", "rewards", "terminated", "truncated", "logp", "values", "final_values",
           "bootstrap_obs", "versions", "episode_ids")  # fmt: skip


_dtype_name = functools.cache(operator.attrgetter("str"))
_dtype = functools.cache(np.dtype)
"""Dtypes' names (``'<f4'``) and the dtypes of names, remembered: both cost more to compute than to look up."""


def _from_fields(fields: dict[str, Any]) -> SampleFragment:
    return SampleFragment(**fields)


def _unpack(layout: tuple[tuple[str, tuple[int, ...]], ...], payload: bytes, scalars: tuple) -> SampleFragment:
    """Rebuild a fragment pickled by :meth:`SampleFragment.__reduce__` (writable arrays over one buffer)."""
    buffer = bytearray(payload)
    arrays, offset = [], 0
    for dtype, shape in layout:
        array = np.ndarray(shape, _dtype(dtype), buffer, offset)
        arrays.append(array)
        offset += array.nbytes
    fields = dict(zip(_ARRAYS, arrays, strict=False))
    state_in = arrays[len(_ARRAYS)] if len(arrays) > len(_ARRAYS) else None
    bootstrap_value, worker_id, env_index, task, created_at = scalars
    return SampleFragment(**fields, bootstrap_value=bootstrap_value, state_in=state_in, worker_id=worker_id,
                          env_index=env_index, task=task, created_at=created_at)  # fmt: skip
