"""A user-defined step environment, as a user would write one: walk right along a corridor to the goal."""

from __future__ import annotations

from typing import Any

import numpy as np


class Corridor:
    """Start at cell 0 of ``length`` cells; action 1 moves right, 0 left (walls hold). Reaching the last cell
    ends the episode (terminated) with reward +1; every step costs ``step_cost``; after ``max_steps`` the episode
    is cut (truncated). The observation is the one-hot cell. The best return is ``1 - (length - 1) * step_cost``.
    """

    action_space_n = 2

    def __init__(self, length: int = 5, max_steps: int = 30, step_cost: float = 0.1) -> None:
        self.length, self.max_steps, self.step_cost = length, max_steps, step_cost
        self.pos = self.t = 0

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.length, np.float32)
        obs[self.pos] = 1.0
        return obs

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        self.pos = self.t = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.pos = int(np.clip(self.pos + (1 if int(action) == 1 else -1), 0, self.length - 1))
        self.t += 1
        at_goal = self.pos == self.length - 1
        reward = (1.0 if at_goal else 0.0) - self.step_cost
        return self._obs(), reward, at_goal, not at_goal and self.t >= self.max_steps, {}

    def close(self) -> None:
        pass
