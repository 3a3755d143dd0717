"""Arithmetic with a verifiable reward: ``"a+b="`` answered with a fixed number of digits.

Problems are all pairs ``(a, b)`` in the given ranges, optionally only those with (or without) a carry. With
``holdout_fraction > 0`` a fixed, seeded split holds out about that share of them: ``mode="train"`` draws only
training problems and ``mode="eval"`` only held-out ones, so evaluation measures generalization to unseen
problems. The split is made over unordered pairs ``{a, b}``, so a problem and its commuted twin ``b+a`` always
fall on the same side (a policy cannot score on a held-out ``b+a`` by having learned ``a+b``), and no held-out
prompt text is ever a training prompt text. With ``holdout_fraction == 0`` evaluation covers every problem
(greedy decoding, its own random stream): the single-digit table is small enough that this measures whether the
policy has learned the whole table (a held-out single-digit sum has nothing in training to be worked out from).

Answers are written zero-padded to ``width`` digits and ended by the end-of-sequence token (``"3+4="`` ->
``"07<eos>"``). An exact answer that stops scores 1; anything else scores half the share of digit positions it
has right (partial credit, still checked against the true sum), so the jump to an exact answer stays the
largest step. Accuracy counts exact answers only. A problem with an aborted completion is left out before
scoring (:func:`~rollhub.envs.group.scored.drop_aborted`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from rollhub.envs.group.base import Mode
from rollhub.envs.group.prompted import PromptedEnv
from rollhub.errors import ConfigError
from rollhub.inference.base import Completion, SamplingParams

Carry = Literal["any", "none", "only"]


class ArithmeticEnv(PromptedEnv[tuple[int, int]]):
    """Addition problems with exact-answer checking and a held-out split that no commuted twin leaks across.

    Attributes:
        train_problems: the ``(a, b)`` pairs ``mode="train"`` draws from, sorted.
        eval_problems: the held-out pairs ``mode="eval"`` draws from, sorted; neither a pair nor its twin
            ``(b, a)`` nor its prompt text is in ``train_problems`` (with no holdout: every problem, as in
            ``train_problems``).

    Args:
        name: the environment (lesson) name written into its groups.
        max_operand: operands range over ``0..max_operand``.
        carry: ``"none"`` keeps problems whose ones digits do not carry, ``"only"`` those that do,
            ``"any"`` all of them.
        holdout_fraction: share of problems kept for ``mode="eval"``, as near as whole twin pairs allow (see
            :meth:`_split`); a problem ``a+b`` and its twin ``b+a`` are always held out together.
        width: digits of every answer (zero-padded).
        temperature: sampling temperature in ``"train"`` mode; ``"eval"`` decodes greedily.
        split_seed: seed of the train / held-out split (same seed, same split, on every worker).
        pad_operands: write operands zero-padded to the width of ``max_operand`` (``"07+35="``), so digits
            of equal place value sit at equal offsets.
    """

    def __init__(
        self,
        name: str = "arithmetic",
        max_operand: int = 9,
        carry: Carry = "any",
        holdout_fraction: float = 0.2,
        width: int = 2,
        temperature: float = 1.0,
        split_seed: int = 0,
        pad_operands: bool = False,
    ) -> None:
        if not 0.0 <= holdout_fraction < 1.0:
            raise ConfigError(f"holdout_fraction {holdout_fraction} must be in [0, 1)")
        if len(str(2 * max_operand)) > width:
            raise ConfigError(f"width {width} cannot hold sums up to {2 * max_operand}; raise width")
        self.name = name
        self.width = width
        self.temperature = temperature
        self.operand_width = len(str(max_operand)) if pad_operands else 0
        pairs = [
            (a, b)
            for a in range(max_operand + 1)
            for b in range(max_operand + 1)
            if carry == "any" or ((a % 10 + b % 10 >= 10) == (carry == "only"))
        ]
        if len(pairs) < 2:
            raise ConfigError(f"carry={carry!r} with max_operand={max_operand} leaves {len(pairs)} problems")
        self.train_problems, self.eval_problems = self._split(pairs, holdout_fraction, split_seed)

    def _split(
        self, pairs: list[tuple[int, int]], holdout_fraction: float, split_seed: int
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Training and held-out problems of ``pairs`` (both sorted; the same list twice with no holdout).

        The seeded permutation orders the unordered pairs ``{a, b}``; walking it, a pair joins the held-out side
        (with its twin ``(b, a)``) while both still fit in ``round(holdout_fraction * len(pairs))`` problems, so
        the held-out count is exactly that whenever enough doubles ``{a, a}`` remain to fill an odd last place,
        and otherwise one short. The carry rule is symmetric, so every twin of a pair is itself a problem.
        """
        if holdout_fraction == 0:
            return list(pairs), list(pairs)
        unordered = sorted({(min(a, b), max(a, b)) for a, b in pairs})
        order = np.random.default_rng(split_seed).permutation(len(unordered))
        room = round(holdout_fraction * len(pairs))
        held: set[tuple[int, int]] = set()
        for i in order:
            a, b = unordered[i]
            twins = {(a, b), (b, a)}
            if len(twins) <= room:
                held |= twins
                room -= len(twins)
        train = [p for p in pairs if p not in held]
        evaluation = [p for p in pairs if p in held]
        if not train or not evaluation:
            raise ConfigError(
                f"holdout_fraction {holdout_fraction} of {len(pairs)} problems leaves a split empty; "
                "choose a fraction that holds out at least one pair and keeps one for training"
            )
        shared = {self.prompt(a, b) for a, b in train} & {self.prompt(a, b) for a, b in evaluation}
        if shared:
            raise ConfigError(f"held-out prompts {sorted(shared)[:3]} are also training prompts; make prompt() unique")
        return train, evaluation

    def prompt(self, a: int, b: int) -> str:
        """The prompt text of ``a + b``."""
        w = self.operand_width
        return f"{a:0{w}d}+{b:0{w}d}=" if w else f"{a}+{b}="

    def answer(self, a: int, b: int) -> str:
        """The expected completion text of ``a+b=``."""
        return str(a + b).zfill(self.width)

    def score(self, completion: Completion, answer: str) -> tuple[float, bool]:
        """Reward and exactness of one completion against the true answer (see the module docstring)."""
        text = completion.text
        if completion.finish_reason == "stop" and text == answer:
            return 1.0, True
        hits = sum(1 for i, ch in enumerate(answer) if i < len(text) and text[i] == ch)
        return 0.5 * hits / len(answer), False

    def draw(self, n_examples: int, mode: Mode, rng: np.random.Generator) -> list[tuple[int, int]]:
        """Training draws with replacement; evaluation without, at most all (so it can cover fewer problems)."""
        pool = self.train_problems if mode == "train" else self.eval_problems
        if mode == "eval":
            picks = rng.permutation(len(pool))[: min(n_examples, len(pool))]
        else:
            picks = rng.integers(len(pool), size=n_examples)
        return [pool[i] for i in picks]

    def prompt_of(self, problem: tuple[int, int]) -> str:
        """:meth:`prompt` of the pair."""
        return self.prompt(*problem)

    def sampling(self, mode: Mode) -> SamplingParams:
        """The answer's digits and ``<eos>``; ``temperature`` in training, greedy in evaluation."""
        return SamplingParams(max_tokens=self.width + 1, temperature=self.temperature if mode == "train" else 0.0)

    def example_id(self, problem: tuple[int, int]) -> str:
        """``"a+b"``."""
        return f"{problem[0]}+{problem[1]}"

    def judge(self, problem: tuple[int, int], completions: list[Completion]) -> tuple[list[float], list[bool]]:
        """Each completion scored against the true answer (:meth:`score`)."""
        answer = self.answer(*problem)
        scored = [self.score(c, answer) for c in completions]
        return [r for r, _ in scored], [ok for _, ok in scored]
