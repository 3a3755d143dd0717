"""The task of the Atropos example, in plain Python (no atroposlib, no rollhub): repeat the last digit.

A prompt is two digits and ``=``, e.g. ``57=``; the answer is the digit just before ``=`` (``7``), one token. Of
the 100 prompts a seeded fifth is held out: never trained on, only evaluated. Every digit still ends some
training prompts, so what is learned on the training prompts (copy the token before ``=``) is what the held-out
ones ask for. A random model answers about one prompt in ten; the tiny model of ``rollhub demo llm`` learns
the copy in a few hundred GRPO updates on a CPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

HOLDOUT_FRACTION = 0.2


@dataclass(frozen=True)
class Problem:
    """One prompt and its answer."""

    prompt: str
    answer: str


class LastDigitTask:
    """The 100 prompts ``ab=`` split into training and held-out problems (seeded).

    Args:
        seed: seeds the split.
    """

    def __init__(self, seed: int = 0) -> None:
        problems = [Problem(f"{a}{b}=", str(b)) for a in range(10) for b in range(10)]
        random.Random(seed).shuffle(problems)
        cut = round(len(problems) * HOLDOUT_FRACTION)
        self.held_out, self.train = problems[:cut], problems[cut:]

    @staticmethod
    def score(problem: Problem, text: str) -> float:
        """1.0 for the answer, 0.0 for anything else."""
        return 1.0 if text == problem.answer else 0.0
