"""A long-completion task with a verifiable reward: a digit string, answered by its last digit repeated.

The prompt is ``prompt_digits`` digits and ``"="`` (``"4719="``); the answer is the prompt's last digit written
``length`` times (``"9999..."``). Every completion is sampled to exactly ``length`` tokens (the end-of-sequence
token does not stop it), so the reward depends on the whole of a long completion: it is the share of the first
``length`` characters that are the prompt's last digit (characters missing count as wrong). A completion is
correct when that share is at least ``pass_share`` (1: every character right). Made to measure what happens to
generations that run while new weights arrive (``benchmarks/partial.py``): every sample is long enough to be running
when a push comes, and a model that learns to repeat its last token solves it.

All ``10 ** prompt_digits`` prompt strings are split once by ``split_seed``: ``mode="eval"`` draws only from the
``n_eval`` held-out strings (without replacement) and ``mode="train"`` only from the others, so no held-out prompt
is ever trained on. A :class:`~rollhub.envs.group.prompted.PromptedEnv`: a problem with an aborted completion
is left out before scoring.
"""

from __future__ import annotations

import numpy as np

from rollhub.envs.group.base import Mode
from rollhub.envs.group.prompted import PromptedEnv
from rollhub.errors import ConfigError
from rollhub.inference.base import Completion, SamplingParams


class RepeatEnv(PromptedEnv[str]):
    """Repeat the prompt's last digit ``length`` times, rewarded by the share of characters right.

    Attributes:
        train_prompts: the prompt strings ``mode="train"`` draws from.
        eval_prompts: the held-out prompt strings ``mode="eval"`` draws from (none of them in ``train_prompts``).

    Args:
        name: the environment (lesson) name written into its groups.
        length: completion tokens of every sample, and characters scored.
        prompt_digits: digits of every prompt before the ``"="``.
        n_eval: prompt strings held out for ``mode="eval"``.
        pass_share: the share of characters a completion needs right to count as correct.
        temperature: sampling temperature in ``"train"`` mode; ``"eval"`` decodes greedily.
        split_seed: seed of the train / held-out split (same seed, same split, on every worker).
    """

    def __init__(
        self,
        name: str = "repeat",
        length: int = 128,
        prompt_digits: int = 4,
        n_eval: int = 64,
        pass_share: float = 1.0,
        temperature: float = 1.0,
        split_seed: int = 0,
    ) -> None:
        if length < 1:
            raise ConfigError(f"length {length} must be at least 1 (completion tokens per sample)")
        if not 1 <= prompt_digits <= 6:
            raise ConfigError(f"prompt_digits {prompt_digits} must be in 1..6 (10 ** prompt_digits prompts are made)")
        if not 0.0 < pass_share <= 1.0:
            raise ConfigError(f"pass_share {pass_share} must be in (0, 1]")
        total = 10**prompt_digits
        if not 1 <= n_eval <= total // 2:
            raise ConfigError(f"n_eval {n_eval} must be in 1..{total // 2} with prompt_digits {prompt_digits}")
        self.name = name
        self.length = length
        self.pass_share = pass_share
        self.temperature = temperature
        order = np.random.default_rng(split_seed).permutation(total)
        texts = [f"{i:0{prompt_digits}d}=" for i in order]
        self.eval_prompts, self.train_prompts = texts[:n_eval], texts[n_eval:]

    def answer(self, prompt: str) -> str:
        """The expected completion of ``prompt``."""
        return prompt[-2] * self.length

    def score(self, completion: Completion, answer: str) -> tuple[float, bool]:
        """Reward and correctness of one completion against its answer (see the module docstring)."""
        text = completion.text[: len(answer)]
        share = sum(1 for got, want in zip(text, answer, strict=False) if got == want) / len(answer)
        return share, share >= self.pass_share

    def draw(self, n_examples: int, mode: Mode, rng: np.random.Generator) -> list[str]:
        """Prompts of ``mode``'s pool: ``"eval"`` draws without replacement, at most all; ``"train"`` with."""
        pool = self.train_prompts if mode == "train" else self.eval_prompts
        if mode == "eval":
            picks = rng.permutation(len(pool))[: min(n_examples, len(pool))]
        else:
            picks = rng.integers(len(pool), size=n_examples)
        return [pool[i] for i in picks]

    def prompt_of(self, problem: str) -> str:
        """The prompt string itself."""
        return problem

    def sampling(self, mode: Mode) -> SamplingParams:
        """``length`` tokens, end-of-sequence ignored; ``temperature`` in training, greedy in evaluation."""
        temperature = self.temperature if mode == "train" else 0.0
        return SamplingParams(max_tokens=self.length, temperature=temperature, stop_eos=False)

    def example_id(self, problem: str) -> str:
        """The prompt's digits."""
        return problem[:-1]

    def judge(self, problem: str, completions: list[Completion]) -> tuple[list[float], list[bool]]:
        """Each completion's share of characters right, and whether it reaches ``pass_share``."""
        scored = [self.score(c, self.answer(problem)) for c in completions]
        return [r for r, _ in scored], [ok for _, ok in scored]
