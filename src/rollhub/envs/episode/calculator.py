"""A task that needs a tool: multiply two numbers with a ``calc`` tool, then answer.

The user asks ``"a*b=?"``. The model should call ``<tool_call>{"name": "calc", "arguments": {"a": A, "b": B}}
</tool_call>``, read the product back, and answer with the product alone. The outcome's reward is 1 for the exact
product as the final answer (the turn that ends the episode, holding no call) after a call that asked ``calc`` for
that product; anything else earns 0.5 times the share of its calls that asked for the right product (an answer
without the tool earns nothing: the task is to use it). A malformed call costs ``malformed_reward`` in its turn
(:class:`~rollhub.envs.episode.base.ToolEnv`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rollhub.envs.episode.base import ToolEnv
from rollhub.envs.episode.episode import Episode
from rollhub.envs.episode.tools import Tool, parse_tool_calls
from rollhub.envs.episode.types import Outcome, Task
from rollhub.envs.group.base import Mode
from rollhub.errors import ConfigError


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
    """

    name: str = "calculator"
    tools: tuple[Tool, ...] = field(default_factory=lambda: (CALC,))
    lo: int = 2
    hi: int = 9

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi:
            raise ConfigError(f"need 0 <= lo < hi, got lo={self.lo} hi={self.hi}")
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
        right = sum(c.name == "calc" and _product(c.arguments) == task.data for c in calls)
        final = answers[-1]["content"].strip() if answers else ""
        if right and episode.finish == "done" and final == str(task.data):
            return Outcome(1.0, True)
        return Outcome(0.5 * right / len(calls) if calls else 0.0)


def _product(arguments: object) -> int | None:
    try:
        return int(calc(**arguments))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
