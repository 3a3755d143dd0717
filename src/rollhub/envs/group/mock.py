"""A deterministic environment for tests: prompts ``"<i>="``, reward = how often the target digit appears.

It needs no trained policy to give informative groups: any policy that samples digits gets rewards that vary
within a group. ``fail_first`` makes the first calls raise, to test a worker's error handling.
"""

from __future__ import annotations

import numpy as np

from rollhub.envs.group.base import Mode
from rollhub.envs.group.prompted import PromptedEnv
from rollhub.errors import RollhubError
from rollhub.inference.base import Completion, SamplingParams


class MockEnvError(RollhubError):
    """Raised on purpose by :class:`MockEnv` when asked to fail."""


class MockEnv(PromptedEnv[int]):
    """Prompts ``"<i>="`` for ``i`` in ``range(n_prompts)``; reward is the share of completion characters
    equal to ``str(i % 10)``; a completion is correct when its first character is that digit.

    Args:
        name: environment name.
        n_prompts: number of distinct prompts.
        max_tokens: completion length cap.
        fail_first: the first this-many ``sample`` calls raise :class:`MockEnvError`.
        empty: return no groups at all (a source that ran dry).
    """

    def __init__(
        self,
        name: str = "mock",
        n_prompts: int = 10,
        max_tokens: int = 4,
        fail_first: int = 0,
        empty: bool = False,
    ) -> None:
        self.name = name
        self.n_prompts = n_prompts
        self.max_tokens = max_tokens
        self.fail_first = fail_first
        self.empty = empty
        self.calls = 0

    def draw(self, n_examples: int, mode: Mode, rng: np.random.Generator) -> list[int]:
        """``n_examples`` prompt indices (raising while ``fail_first`` lasts; none with ``empty``)."""
        self.calls += 1
        if self.calls <= self.fail_first:
            raise MockEnvError(f"mock environment failing on purpose (call {self.calls} of {self.fail_first})")
        if self.empty:
            return []
        return [int(i) for i in rng.integers(self.n_prompts, size=n_examples)]

    def prompt_of(self, problem: int) -> str:
        """``"<i>="``."""
        return f"{problem}="

    def sampling(self, mode: Mode) -> SamplingParams:
        """Temperature 1 in training, greedy in evaluation."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=1.0 if mode == "train" else 0.0)

    def example_id(self, problem: int) -> str:
        """The prompt index."""
        return str(problem)

    def judge(self, problem: int, completions: list[Completion]) -> tuple[list[float], list[bool]]:
        """The share of characters equal to the target digit; correct when the first one is."""
        target = str(problem % 10)
        rewards = [c.text.count(target) / max(len(c.text), 1) for c in completions]
        return rewards, [c.text[:1] == target for c in completions]
