"""The task of the Atropos example as a rollhub group environment, for rollhub's own held-out evaluation
(``env.eval_id = "examples.atropos_env.rollhub_eval:LastDigitEval"``): the trainer evaluates its weights on the
held-out prompts between two updates, so no evaluated answer straddles a weight push."""

from __future__ import annotations

import numpy as np
from examples.atropos_env.task import LastDigitTask

from rollhub.envs.group.base import Mode, summarize
from rollhub.envs.group.scored import drop_aborted, make_group
from rollhub.experience import Group
from rollhub.inference.base import InferenceContext, SamplingParams


class LastDigitEval:
    """``mode="eval"``: every held-out prompt once, greedy; ``mode="train"``: training prompts at temperature 1.

    Args:
        name: the environment's name in its groups.
        split_seed: the task's split (the Atropos environment's ``--env.split_seed``).
    """

    def __init__(self, name: str = "last_digit", split_seed: int = 0) -> None:
        self.name = name
        self.task = LastDigitTask(split_seed)

    def sample(self, inference_ctx: InferenceContext, n_examples: int, n_generations: int, mode: Mode,
               rng: np.random.Generator) -> tuple[list[Group], dict[str, float]]:  # fmt: skip
        """Score ``n_generations`` one-token answers to ``n_examples`` prompts (eval: each held-out one, once)."""
        if mode == "eval":
            problems, n, params = self.task.held_out[:n_examples], 1, SamplingParams(max_tokens=1, temperature=0.0)
        else:
            picked = rng.integers(len(self.task.train), size=n_examples)
            problems, n = [self.task.train[i] for i in picked], n_generations
            params = SamplingParams(max_tokens=1, temperature=1.0)
        completions = inference_ctx.complete([p.prompt for p in problems], n, params, rng)
        groups = []
        for problem, comps in drop_aborted(problems, completions)[0]:
            rewards = [self.task.score(problem, c.text) for c in comps]
            groups.append(make_group(self.name, problem.prompt, comps, rewards, [r == 1.0 for r in rewards]))
        return groups, summarize(groups)
