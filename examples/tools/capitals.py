"""A multi-turn tool environment for ``rollhub run``: look up a country's capital with a tool, then answer.

The model is asked ``"What is the capital of peru?"``; it should call ``capital`` (in its chat template's tool
format, Qwen's ``<tool_call>{"name": "capital", "arguments": {"country": "peru"}}</tool_call>`` by default), read
the result, and answer with the city alone. ``capitals.toml`` beside this file trains it; ``rollhub run`` finds this
module because it sits beside the config (``env.id = "capitals:CapitalsEnv"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rollhub.envs.episode import Episode, Outcome, Task, Tool, ToolEnv, parse_tool_calls

CAPITALS = {
    "france": "paris", "japan": "tokyo", "peru": "lima", "kenya": "nairobi", "canada": "ottawa",
    "egypt": "cairo", "norway": "oslo", "chile": "santiago", "india": "new delhi", "spain": "madrid",
}  # fmt: skip
HELD_OUT = ("chile", "norway")  # asked only in evaluation


def capital(country: str) -> str:
    """The tool: the capital of ``country`` (a ``KeyError`` goes back to the model as the call's error)."""
    return CAPITALS[country.strip().lower()]


LOOKUP = Tool(
    name="capital",
    description="the capital city of a country",
    parameters={"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]},
    fn=capital,
)


@dataclass
class CapitalsEnv(ToolEnv):
    """1 for the right capital answered after a call to ``capital``; 0 otherwise. A malformed call costs its turn
    ``malformed_reward`` (:class:`~rollhub.envs.episode.ToolEnv`).

    Attributes:
        require_tool: whether an answer given without calling the tool scores 0.
    """

    name: str = "capitals"
    tools: tuple[Tool, ...] = field(default_factory=lambda: (LOOKUP,))
    malformed_reward: float = -0.1
    require_tool: bool = True

    def tasks(self, n: int, mode: str, rng: np.random.Generator) -> list[Task]:
        """``n`` training countries drawn with replacement, or the held-out ones in evaluation."""
        pool = list(HELD_OUT) if mode == "eval" else sorted(set(CAPITALS) - set(HELD_OUT))
        countries = rng.choice(pool, size=n) if mode == "train" else pool[:n]
        return [Task(c, [{"role": "user", "content": f"What is the capital of {c}?"}], self.tool_schemas(), c)
                for c in map(str, countries)]  # fmt: skip

    def outcome(self, task: Task, episode: Episode) -> Outcome:
        """Right when the episode ended by answering (not on a budget) with the capital, after a lookup."""
        answers = [m["content"] for m in episode.messages if m["role"] == "assistant"]
        looked_up = any(c.name == "capital" for a in answers for c in parse_tool_calls(a))
        final = answers[-1].strip().lower().rstrip(".") if answers else ""
        right = episode.finish == "done" and final == CAPITALS[task.data] and (looked_up or not self.require_tool)
        return Outcome(1.0 if right else 0.0, correct=right)
