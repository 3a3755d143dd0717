"""A user-defined group environment, as a user would write one: answer with the digit shown."""

from __future__ import annotations

import numpy as np

from rollhub.envs.group.base import Mode, summarize
from rollhub.envs.group.scored import drop_aborted, make_group
from rollhub.experience import Group
from rollhub.inference.base import Completion, InferenceContext, SamplingParams


class EchoDigit:
    """Prompt ``"d="`` for a digit ``d``; the answer is ``d`` and the end of the sequence.

    Reward: 1 for the exact answer; 0.5 when the first character is ``d`` but the completion goes on; 0.1 for
    another digit first; 0 otherwise. Accuracy counts exact answers. ``mode="train"`` samples at temperature 1,
    ``mode="eval"`` decodes greedily over every digit once.
    """

    def __init__(self, name: str = "echo", digits: str = "0123456789") -> None:
        self.name = name
        self.digits = digits

    def score(self, completion: Completion, digit: str) -> tuple[float, bool]:
        """Reward and exactness of one completion."""
        text = completion.text
        if completion.finish_reason == "stop" and text == digit:
            return 1.0, True
        if text[:1] == digit:
            return 0.5, False
        return (0.1 if text[:1].isdigit() else 0.0), False

    def sample(self, inference_ctx: InferenceContext, n_examples: int, n_generations: int, mode: Mode,
               rng: np.random.Generator) -> tuple[list[Group], dict[str, float]]:  # fmt: skip
        """Draw ``n_examples`` digits (eval: every digit once) and score ``n_generations`` answers to each."""
        if mode == "eval":
            picked = list(self.digits)[:n_examples]
        else:
            picked = [self.digits[i] for i in rng.integers(len(self.digits), size=n_examples)]
        params = SamplingParams(max_tokens=2, temperature=1.0 if mode == "train" else 0.0)
        completions = inference_ctx.complete([f"{d}=" for d in picked], n_generations, params, rng)
        groups = []
        for digit, comps in drop_aborted(picked, completions)[0]:  # an aborted completion is never scored
            scored = [self.score(c, digit) for c in comps]
            groups.append(make_group(self.name, digit, comps, [r for r, _ in scored], [ok for _, ok in scored]))
        return groups, summarize(groups)
