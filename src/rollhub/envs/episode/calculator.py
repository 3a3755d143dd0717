"""A task that needs a tool: multiply two numbers with a ``calc`` tool, then answer.

The user asks ``"a*b=?"``. The model should call ``<tool_call>{"name": "calc", "arguments": {"a": A, "b": B}}
</tool_call>``, read the product back, and answer with the product alone. The outcome's reward is 1 for the exact
product as the final answer (the turn that ends the episode, holding no call) after a call that asked ``calc`` for that
product; anything else earns 0.5 times the share of its calls that asked for the right product (an answer without the
tool earns nothing: the task is to use it). With ``operand_reward`` above 0 (a shaping, off by default), an episode that
is not solved also earns ``operand_reward`` for each of the question's operands its calls carry (counted as a multiset,
so ``calc(b, a)`` carries both; averaged over its calls): the signal to learn which numbers go into the call from, where
a right product alone is rare. A solved episode earns 1 either way. A malformed call costs ``malformed_reward`` in its
turn (:class:`~rollhub.envs.episode.base.ToolEnv`). :func:`judge` is that rule on its own, for an agent that keeps its
own record of the calls (the gateway's agents).

**A warm start by demonstration** (:func:`warm_start_groups`): episodes in which a script, not the model, writes the
turns (:func:`demonstration_script`). Each demonstration follows one of three behaviours, drawn per episode: a call
with the question's operands (``right_share`` of them), an answer guessed at once without the tool (``guess_share``),
or a call that slips, carrying the question's first operand twice (``calc(a, a)``: wrong unless ``a == b``); after a
call, the answer copies the tool's reply. A model fine-tuned on them writes well-formed calls and copies results, but
samples each behaviour about as often as the demonstrations show it, and where the slip is shown more often than the
right call, its likeliest call is the slip: a greedy decoder fails too. Which behaviour earns the reward is left for
reinforcement learning to find. The demonstrations ask training problems only; the held-out problems are never in
them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rollhub.envs.episode.base import ToolEnv
from rollhub.envs.episode.episode import Episode, episodes_to_group
from rollhub.envs.episode.render import ChatRenderer
from rollhub.envs.episode.runner import run_episodes
from rollhub.envs.episode.scripted import ScriptedPolicy
from rollhub.envs.episode.tools import Tool, parse_tool_calls
from rollhub.envs.episode.types import EpisodeLimits, Outcome, Task
from rollhub.envs.group.base import Mode
from rollhub.errors import ConfigError
from rollhub.experience import Group
from rollhub.inference.base import SamplingParams


def calc(a: int, b: int) -> str:
    """The calculator: the product of two integers."""
    if not (isinstance(a, int) and isinstance(b, int)):
        raise ValueError(f"a and b must be integers, got {a!r} and {b!r}")
    return str(a * b)


CALC = Tool(
    name="calc",
    description="multiply two integers",
    parameters={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    fn=calc,
)


@dataclass
class CalculatorEnv(ToolEnv):
    """Products ``a*b`` for ``a, b`` in ``lo..hi``; every tenth pair (in a fixed order) is held out for ``eval``.

    Attributes:
        lo, hi: the operands' range.
        operand_reward: the shaping reward per question operand a call carries (module docstring; 0: off).
    """

    name: str = "calculator"
    tools: tuple[Tool, ...] = field(default_factory=lambda: (CALC,))
    lo: int = 2
    hi: int = 9
    operand_reward: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi:
            raise ConfigError(f"need 0 <= lo < hi, got lo={self.lo} hi={self.hi}")
        if not 0 <= self.operand_reward < 0.25:
            raise ConfigError(f"operand_reward {self.operand_reward} must be in [0, 0.25) (a solved episode must "
                              "earn more than any unsolved one)")  # fmt: skip
        pairs = [(a, b) for a in range(self.lo, self.hi + 1) for b in range(self.lo, self.hi + 1)]
        self.eval_problems = pairs[::10]
        self.train_problems = [p for i, p in enumerate(pairs) if i % 10]

    def task(self, a: int, b: int) -> Task:
        """The task ``a*b``."""
        return Task(f"{a}*{b}", [{"role": "user", "content": f"{a}*{b}=?"}], self.tool_schemas(), a * b)

    def tasks(self, n: int, mode: Mode, rng: np.random.Generator) -> list[Task]:
        """``n`` training problems drawn with replacement, or up to ``n`` held-out ones without."""
        pool = self.train_problems if mode == "train" else self.eval_problems
        picks = rng.integers(len(pool), size=n) if mode == "train" else rng.permutation(len(pool))[:n]
        return [self.task(*pool[i]) for i in picks]

    def outcome(self, task: Task, episode: Episode) -> Outcome:
        """1 for the exact product answered after a right call; else credit for right calls (module docstring)."""
        answers = [m for m in episode.messages if m["role"] == "assistant"]
        calls = [c for m in answers for c in parse_tool_calls(m["content"])]
        ran = [_operands(c.arguments) if c.name == "calc" else None for c in calls]
        final = answers[-1]["content"] if answers else ""
        return judge(operands(task), ran, final, episode.finish == "done", self.operand_reward)


def operands(task: Task) -> tuple[int, int]:
    """The operands of a calculator task (its id is ``"a*b"``)."""
    a, b = task.id.split("*")
    return int(a), int(b)


def judge(question: tuple[int, int], calls: Sequence[tuple[int, int] | None], final: str, ended: bool,
          operand_reward: float = 0.0) -> Outcome:  # fmt: skip
    """The task's reward (module docstring) for the question's operands, the operands of each call the episode
    made (``None`` for a call that failed or named another tool), its final answer, and whether it ended by
    answering."""
    product = question[0] * question[1]
    right = sum(c is not None and c[0] * c[1] == product for c in calls)
    if right and ended and final.strip() == str(product):
        return Outcome(1.0, True)
    if not calls:
        return Outcome(0.0)
    carried = sum(_shared(question, c) for c in calls if c is not None)
    return Outcome((0.5 * right + operand_reward * carried) / len(calls))


def _shared(question: tuple[int, int], call: tuple[int, int]) -> int:
    left = list(question)
    for x in call:
        if x in left:
            left.remove(x)
    return 2 - len(left)


def _operands(arguments: object) -> tuple[int, int] | None:
    try:
        calc(**arguments)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return arguments["a"], arguments["b"]  # type: ignore[index]


_QUESTION = re.compile(r"user: (\d+)\*(\d+)=\?")
_RESULT = re.compile(r"<tool_response>([^<]*)</tool_response>")


def demonstration_script(lo: int, hi: int, right_share: float = 0.25, guess_share: float = 0.25
                         ) -> Callable[[str, np.random.Generator], str]:  # fmt: skip
    """The warm start's writer (module docstring). On the first turn it draws a behaviour: a call to ``calc`` with
    the question's operands (``right_share``), an answer guessed without the tool (``guess_share``: a product of two
    operands from ``lo..hi`` that is not the question's), or else the slip, a call carrying the question's first
    operand twice. On a later turn it copies the last tool result."""
    if not 0 <= lo < hi:
        raise ConfigError(f"need 0 <= lo < hi, got lo={lo} hi={hi}")
    if not (0 <= right_share <= 1 and 0 <= guess_share <= 1 and right_share + guess_share <= 1):
        raise ConfigError(f"right_share {right_share} and guess_share {guess_share} must be shares in [0, 1] with a "
                          "sum of at most 1 (the rest are slips)")  # fmt: skip

    def script(text: str, rng: np.random.Generator) -> str:
        results = _RESULT.findall(text)
        if results:
            return results[-1]
        asked = _QUESTION.findall(text)
        if not asked:
            raise ValueError("the conversation holds no question 'user: A*B=?'")
        a, b = int(asked[-1][0]), int(asked[-1][1])
        draw = rng.random()
        if draw < guess_share:
            while True:
                x, y = (int(v) for v in rng.integers(lo, hi + 1, size=2))
                if x * y != a * b:
                    return str(x * y)
        if draw >= guess_share + right_share:
            b = a  # the slip
        return f'<tool_call>{{"name": "calc", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'

    return script


def warm_start_groups(env: CalculatorEnv, renderer: ChatRenderer, problems: Sequence[tuple[int, int]], n: int,
                      limits: EpisodeLimits, rng: np.random.Generator, right_share: float = 0.25,
                      guess_share: float = 0.25) -> list[Group]:  # fmt: skip
    """``n`` demonstrations (module docstring) of problems drawn from ``problems``, run through the episode loop with
    :func:`demonstration_script` writing the turns; one group each (its ``masks`` mark the scripted turns)."""
    if not problems:
        raise ConfigError("no warm-start problems: pass some training problems (CalculatorEnv.train_problems)")
    held_out = set(problems) & set(env.eval_problems)
    if held_out:
        raise ConfigError(f"warm-start problems include held-out ones {sorted(held_out)}: demonstrate training "
                          "problems only (CalculatorEnv.train_problems)")  # fmt: skip
    policy = ScriptedPolicy(renderer.tokenizer, demonstration_script(env.lo, env.hi, right_share, guess_share))
    tasks = [env.task(*problems[i]) for i in rng.integers(len(problems), size=n)]
    runs = run_episodes(env, policy, renderer, tasks, 1, limits, SamplingParams(), rng)
    return [episodes_to_group(env.name, eps, limits.discount, SamplingParams().generation_params()) for eps in runs]
