"""Built-in step environments that need nothing beyond numpy.

``sleep``: a synthetic environment whose ``step`` takes a fixed time, so rollout throughput can be measured
against a known ideal (``n_envs / step_s`` steps per second) without the cost of a real simulator.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rollhub.errors import ConfigError


class SleepEnv:
    """A step environment whose ``step`` takes ``step_s`` seconds and ends episodes by time limit.

    A step sleeps until ``spin_s`` before its deadline and then waits out the rest in a loop: an operating
    system's sleep wakes late (about 70 µs on a virtual machine, even with a small timer slack), and a
    2 ms step that takes 2.07 ms would put the ideal out of anyone's reach. ``spin_s = 0`` sleeps plainly.

    Observations are ``obs_dim`` float32 values drawn from a seeded generator; the reward is 1 per step; an
    episode is truncated (never terminated) after ``episode_length`` steps. ``action_space_n`` is exposed so
    discrete policies can be sized for it.

    Args:
        step_s: seconds each ``step`` sleeps (0 allowed).
        obs_dim: length of the observation vector.
        episode_length: steps before the episode is truncated.
        n_actions: size of the discrete action space.
        spin_s: the last part of a step spent waiting in a loop instead of asleep (at most ``step_s``).
    """

    def __init__(self, step_s: float = 0.002, obs_dim: int = 4, episode_length: int = 200, n_actions: int = 2,
                 spin_s: float = 0.0) -> None:  # fmt: skip
        if step_s < 0 or obs_dim < 1 or episode_length < 1 or n_actions < 1 or spin_s < 0:
            raise ConfigError(
                f"SleepEnv needs step_s >= 0, spin_s >= 0 and positive sizes, got step_s={step_s}, "
                f"spin_s={spin_s}, obs_dim={obs_dim}, episode_length={episode_length}, n_actions={n_actions}"
            )
        self.step_s = step_s
        self.spin_s = min(spin_s, step_s)
        self.obs_dim = obs_dim
        self.episode_length = episode_length
        self.action_space_n = n_actions
        self._rng = np.random.default_rng()
        self._t = 0

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """Start an episode; ``seed`` reseeds the observation generator."""
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._t = 0
        return self._rng.standard_normal(self.obs_dim).astype(np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Take ``step_s``, then return a new observation, reward 1 and the time-limit flag."""
        if self.step_s > 0:
            deadline = time.perf_counter() + self.step_s
            if self.step_s > self.spin_s:
                time.sleep(self.step_s - self.spin_s)
            while time.perf_counter() < deadline:
                pass
        self._t += 1
        obs = self._rng.standard_normal(self.obs_dim).astype(np.float32)
        return obs, 1.0, False, self._t >= self.episode_length, {}

    def close(self) -> None:
        """Nothing to release."""


BUILTIN_ENVS: dict[str, Callable[..., Any]] = {"sleep": SleepEnv}
"""Built-in environment constructors by name, as :class:`rollhub.envs.step.EnvSpec` resolves them."""
