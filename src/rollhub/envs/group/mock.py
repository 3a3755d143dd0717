"""A deterministic environment for tests: prompts ``"<i>="``, reward = how often the target digit appears.

It needs no trained policy to give informative groups: any policy that samples digits gets rewards that vary
within a group. ``fail_first`` makes the first calls raise, to test a worker's error handling.
"""

from __future__ import annotations

import numpy as np

from rollhub.envs.group.base import Mode, rollout_from_completion, summarize
from rollhub.errors import RollhubError
from rollhub.inference.base import InferenceContext, SamplingParams
from rollhub.rollout_types import RolloutGroup


class MockEnvError(RollhubError):
    """Raised on purpose by :class:`MockEnv` when asked to fail."""


class MockEnv:
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

    def sample(
        self,
        inference_ctx: InferenceContext,
        n_examples: int,
        n_generations: int,
        mode: Mode,
        rng: np.random.Generator,
    ) -> tuple[list[RolloutGroup], dict[str, float]]:
        """See :class:`~rollhub.envs.group.base.GroupEnv`."""
        self.calls += 1
        if self.calls <= self.fail_first:
            raise MockEnvError(f"mock environment failing on purpose (call {self.calls} of {self.fail_first})")
        if self.empty:
            return [], summarize([])
        ids = rng.integers(self.n_prompts, size=n_examples)
        params = SamplingParams(max_tokens=self.max_tokens, temperature=1.0 if mode == "train" else 0.0)
        completions = inference_ctx.complete([f"{i}=" for i in ids], n_generations, params, rng)
        groups = []
        for i, comps in zip(ids, completions, strict=True):
            target = str(int(i) % 10)
            rollouts = []
            for c in comps:
                reward = c.text.count(target) / max(len(c.text), 1)
                rollouts.append(rollout_from_completion(self.name, str(int(i)), c, reward, c.text[:1] == target))
            groups.append(RolloutGroup(tuple(rollouts)))
        return groups, summarize(groups)
