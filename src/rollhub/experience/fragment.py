"""The step fragment: ``L`` consecutive steps of one environment, the unit a step-environment learner trains on.

Cut by :class:`rollhub.rollout.fragments.FragmentBuffer` at ``fragment_length + 1`` records, so the last
transition's reward and the bootstrap observation are known when the fragment leaves its worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
