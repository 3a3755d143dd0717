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

**A format warm start** (:func:`warm_start_groups`): episodes in which a script, not the model, writes a well-formed
call whose operands are *not* the question's (drawn at random, never giving the question's product), reads the tool's
reply and answers with it. A model fine-tuned on them writes calls and copies results, but has never seen a right call,
so it cannot solve the task: what it takes to put the question's operands into the call is left for reinforcement
learning. :meth:`CalculatorEnv.split_warm_start` takes the problems these episodes ask out of the training pool, so the
warm start, the training and the held-out problems share none.
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

    def split_warm_start(self, every: int = 3) -> list[tuple[int, int]]:
        """Take every ``every``-th training problem out of the training pool and return them: the problems a warm
        start may ask, shared with neither the training nor the held-out problems."""
        if every < 2:
            raise ConfigError(f"every must be >= 2 (at 1 no training problem would be left), got {every}")
        taken = self.train_problems[::every]
        self.train_problems = [p for i, p in enumerate(self.train_problems) if i % every]
        return taken

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


def format_script(lo: int, hi: int) -> Callable[[str, np.random.Generator], str]:
    """The warm start's writer (module docstring): on the first turn a call to ``calc`` with operands drawn from
    ``lo..hi`` whose product is not the question's, on the next the last tool result, copied."""
    if not 0 <= lo < hi:
        raise ConfigError(f"need 0 <= lo < hi, got lo={lo} hi={hi}")

    def script(text: str, rng: np.random.Generator) -> str:
        results = _RESULT.findall(text)
        if results:
            return results[-1]
        asked = _QUESTION.findall(text)
        if not asked:
            raise ValueError("the conversation holds no question 'user: A*B=?'")
        product = int(asked[-1][0]) * int(asked[-1][1])
        while True:
            a, b = (int(x) for x in rng.integers(lo, hi + 1, size=2))
            if a * b != product:
                return f'<tool_call>{{"name": "calc", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'

    return script


def warm_start_groups(env: CalculatorEnv, renderer: ChatRenderer, problems: Sequence[tuple[int, int]], n: int,
                      limits: EpisodeLimits, rng: np.random.Generator) -> list[Group]:  # fmt: skip
    """``n`` warm-start episodes (module docstring) of problems drawn from ``problems``, run through the episode
    loop with :func:`format_script` writing the turns; one group each (its ``masks`` mark the scripted turns)."""
    if not problems:
        raise ConfigError("no warm-start problems: take some with CalculatorEnv.split_warm_start")
    policy = ScriptedPolicy(renderer.tokenizer, format_script(env.lo, env.hi))
    tasks = [env.task(*problems[i]) for i in rng.integers(len(problems), size=n)]
    runs = run_episodes(env, policy, renderer, tasks, 1, limits, SamplingParams(), rng)
    return [episodes_to_group(env.name, eps, limits.discount, SamplingParams().generation_params()) for eps in runs]
