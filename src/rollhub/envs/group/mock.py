"""A deterministic environment for tests: prompts ``"<i>="``, reward = how often the target digit appears.

It needs no trained policy to give informative groups: any policy that samples digits gets rewards that vary
within a group. ``fail_first`` makes the first calls raise, to test a worker's error handling.
"""

from __future__ import annotations

import numpy as np

from rollhub.envs.group.base import Mode, summarize
from rollhub.envs.group.scored import drop_aborted, make_group
from rollhub.errors import RollhubError
from rollhub.experience import Group
from rollhub.inference.base import InferenceContext, SamplingParams


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
    ) -> tuple[list[Group], dict[str, float]]:
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
        for i, comps in drop_aborted(list(ids), completions)[0]:
            target = str(int(i) % 10)
            rewards = [c.text.count(target) / max(len(c.text), 1) for c in comps]
            correct = [c.text[:1] == target for c in comps]
            groups.append(make_group(self.name, str(int(i)), comps, rewards, correct))
        return groups, summarize(groups)
