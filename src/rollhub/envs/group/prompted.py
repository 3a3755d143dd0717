"""`PromptedEnv`: the usual shape of a group environment, with its ``sample`` written once.

Most group environments do the same five things in each ``sample`` call: draw problems, turn each into a
prompt, sample ``n_generations`` completions of every prompt, leave out the problems with an aborted completion
(:func:`~rollhub.envs.group.scored.drop_aborted`) and score the others into one group each
(:func:`~rollhub.envs.group.scored.make_group`). A subclass says only what differs: which problems it draws,
the prompt of one, the sampling settings of a mode, and how one problem's completions score.
"""

from __future__ import annotations

import abc
from typing import Generic, TypeVar

import numpy as np

from rollhub.envs.group.base import Mode, summarize
from rollhub.envs.group.scored import drop_aborted, make_group
from rollhub.experience import Group
from rollhub.inference.base import Completion, InferenceContext, SamplingParams

P = TypeVar("P")


class PromptedEnv(abc.ABC, Generic[P]):
    """A :class:`~rollhub.envs.group.base.GroupEnv` that draws problems of type ``P`` and makes one group of
    each problem's completions.

    Attributes:
        name: the environment's name, written into every group it makes.
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
        """See :class:`~rollhub.envs.group.base.GroupEnv`. No problems drawn: no completions asked for; a
        problem with an aborted completion gives no group (so a call can make fewer groups than problems)."""
        problems = self.draw(n_examples, mode, rng)
        if not problems:
            return [], summarize([])
        prompts = [self.prompt_of(p) for p in problems]
        completions = inference_ctx.complete(prompts, n_generations, self.sampling(mode), rng)
        groups = []
        for problem, comps in drop_aborted(problems, completions)[0]:
            rewards, correct = self.judge(problem, comps)
            groups.append(make_group(self.name, self.example_id(problem), comps, rewards, correct))
        return groups, summarize(groups)

    @abc.abstractmethod
    def draw(self, n_examples: int, mode: Mode, rng: np.random.Generator) -> list[P]:
        """The problems of one call (at most ``n_examples``; ``rng`` is the call's only randomness)."""

    @abc.abstractmethod
    def prompt_of(self, problem: P) -> str:
        """The prompt text of ``problem``."""

    @abc.abstractmethod
    def sampling(self, mode: Mode) -> SamplingParams:
        """The sampling settings of ``mode`` (evaluation usually decodes greedily)."""

    @abc.abstractmethod
    def example_id(self, problem: P) -> str:
        """The id of ``problem`` written into its group."""

    @abc.abstractmethod
    def judge(self, problem: P, completions: list[Completion]) -> tuple[list[float], list[bool]]:
        """Each completion's reward, and whether it is correct."""
