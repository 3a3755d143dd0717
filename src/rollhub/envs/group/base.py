"""The group environment protocol: prompts in, groups of scored completions out (the LLM case).

A group environment owns its prompts, its answer checking and its sampling settings; the policy it talks to
is passed in as an :class:`~rollhub.inference.base.InferenceContext`, so the same environment runs against a
local torch model or an OpenAI-compatible server.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import numpy as np

from rollhub.envs.group.scored import GroupStats
from rollhub.experience import Group
from rollhub.inference.base import InferenceContext

Mode = Literal["train", "eval"]


@runtime_checkable
class GroupEnv(Protocol):
    """An environment that produces groups of sampled completions with rewards.

    Attributes:
        name: the environment's name, written into every group it makes (see :mod:`rollhub.envs.group.scored`).
    """

    name: str

    def sample(
        self,
        inference_ctx: InferenceContext,
        n_examples: int,
        n_generations: int,
        mode: Mode,
        rng: np.random.Generator,
    ) -> tuple[list[Group], dict[str, float]]:
        """Draw ``n_examples`` prompts and ``n_generations`` completions of each, scored.

        Args:
            inference_ctx: the policy to sample from.
            n_examples: number of prompts (groups).
            n_generations: completions per prompt (group size).
            mode: ``"train"`` draws training prompts; ``"eval"`` draws held-out prompts.
            rng: the only source of randomness, so a seed reproduces the prompts drawn.

        Before scoring, pass the completions through :func:`~rollhub.envs.group.scored.drop_aborted`: a prompt
        with an aborted completion (``finish_reason == "abort"``) is left out whole, never scored, and
        :func:`~rollhub.envs.group.scored.make_group` refuses one.

        Returns:
            the groups (:func:`~rollhub.envs.group.scored.make_group`; possibly fewer than asked when prompts
            run out or a prompt had an aborted completion) and scalar metrics.
        """
        ...


def summarize(groups: list[Group]) -> dict[str, float]:
    """The metrics every group environment reports: mean reward, accuracy, groups with any reward spread."""
    stats = GroupStats.of(groups)
    return {
        "mean_reward": stats.mean_reward,
        "accuracy": stats.accuracy,
        "informative_groups": stats.informative_groups,
    }
