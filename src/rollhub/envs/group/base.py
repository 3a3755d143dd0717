"""The group environment protocol: prompts in, groups of scored completions out (the LLM case).

A group environment owns its prompts, its answer checking and its sampling settings; the policy it talks to
is passed in as an :class:`~rollhub.inference.base.InferenceContext`, so the same environment runs against a
local torch model or an OpenAI-compatible server.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import numpy as np

from rollhub.inference.base import Completion, InferenceContext
from rollhub.rollout_types import Rollout, RolloutGroup

Mode = Literal["train", "eval"]


@runtime_checkable
class GroupEnv(Protocol):
    """An environment that produces groups of sampled completions with rewards.

    Attributes:
        name: the environment's name, written into every rollout it makes.
    """

    name: str

    def sample(
        self,
        inference_ctx: InferenceContext,
        n_examples: int,
        n_generations: int,
        mode: Mode,
        rng: np.random.Generator,
    ) -> tuple[list[RolloutGroup], dict[str, float]]:
        """Draw ``n_examples`` prompts and ``n_generations`` completions of each, scored.

        Args:
            inference_ctx: the policy to sample from.
            n_examples: number of prompts (groups).
            n_generations: completions per prompt (group size).
            mode: ``"train"`` draws training prompts; ``"eval"`` draws held-out prompts.
            rng: the only source of randomness, so a seed reproduces the prompts drawn.

        Returns:
            the groups (possibly fewer than asked when prompts run out) and scalar metrics.
        """
        ...


def rollout_from_completion(
    env_name: str, example_id: str, completion: Completion, reward: float, correct: bool
) -> Rollout:
    """A :class:`Rollout` (without metadata) of one scored completion."""
    return Rollout(
        env_name=env_name,
        env_example_id=example_id,
        prompt_tokens=completion.prompt_tokens,
        response_tokens=completion.tokens,
        response_logprobs=completion.logprobs,
        episode_reward=float(reward),
        correct=bool(correct),
    )


def summarize(groups: list[RolloutGroup]) -> dict[str, float]:
    """The metrics every group environment reports: mean reward, accuracy, groups with any reward spread."""
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts:
        return {"mean_reward": 0.0, "accuracy": 0.0, "informative_groups": 0.0}
    spread = [float(np.ptp(g.rewards) > 0) for g in groups]
    return {
        "mean_reward": float(np.mean([r.episode_reward for r in rollouts])),
        "accuracy": float(np.mean([r.correct for r in rollouts])),
        "informative_groups": float(np.mean(spread)),
    }
