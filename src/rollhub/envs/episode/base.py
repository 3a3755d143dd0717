"""The multi-turn environment protocol: tasks in, episodes of alternating model and environment turns out.

Beside :class:`~rollhub.envs.group.base.GroupEnv` (one prompt, one completion), an :class:`EpisodeEnv` answers each
model turn with an :class:`EnvReply`: messages to append (tool results, a user's next question), an optional
per-turn reward, and whether the episode is done. The runner (:mod:`rollhub.envs.episode.runner`) owns the loop,
the tokens and the budget; the environment owns only the task's meaning:

* :meth:`EpisodeEnv.tasks` draws tasks (a first conversation, the tools it offers, whatever the environment needs
  to judge it);
* :meth:`EpisodeEnv.step` reads one model turn and replies;
* :meth:`EpisodeEnv.outcome` judges the finished episode (also a truncated one) with the episode's reward.

An episode's *score* (what GRPO compares within a group of ``n`` episodes of one task) is
``sum_t discount**t * r_t``, where ``r_t`` is the reward of model turn ``t`` (counting from 0) and the outcome's
reward counts as part of the last turn's: with ``discount = 0.9`` the same answer is worth 1, 0.9 or 0.81 when
given in the first, second or third turn. With the default ``discount = 1`` the score is the sum of all rewards.

:class:`ToolEnv` is the base of tool-using environments: its ``step`` parses the calls the model wrote in its
template's tool format, runs them, and replies with one ``tool`` message per call; a turn with no call is the
answer and ends the episode. A malformed call is answered with an error message and scored ``malformed_reward``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rollhub.envs.episode.episode import Episode
from rollhub.envs.episode.tools import Tool, parse_tool_calls, run_tool_call
from rollhub.envs.episode.types import EnvReply, ModelTurn, Outcome, Task
from rollhub.envs.group.base import Mode


@runtime_checkable
class EpisodeEnv(Protocol):
    """A multi-turn environment (see the module docstring).

    Attributes:
        name: written into every group its episodes make.
    """

    name: str

    def tasks(self, n: int, mode: Mode, rng: np.random.Generator) -> list[Task]:
        """Draw ``n`` tasks (fewer when the pool runs out); ``rng`` is the only randomness."""
        ...

    def step(self, task: Task, episode: Episode, turn: ModelTurn) -> EnvReply:
        """Reply to model turn ``turn`` of ``episode`` (its messages already include the turn)."""
        ...

    def outcome(self, task: Task, episode: Episode) -> Outcome:
        """Judge the finished ``episode`` (``episode.finish`` says how it ended; a truncated one is judged too)."""
        ...


@dataclass
class ToolEnv:
    """Base of tool-using environments: ``step`` runs the tools the model calls (see the module docstring).

    Subclasses give ``name``, ``tools``, :meth:`tasks` and :meth:`outcome`. Each call's result (or error) is a
    ``tool`` message; ``episode.state["tool_calls"]`` and ``["tool_errors"]`` count the calls and the failed
    ones. A turn holding no call ends the episode.

    Attributes:
        name: the environment's name.
        tools: the tools the model may call.
        malformed_reward: the reward of a turn for each call that failed (malformed, unknown tool, refused
            arguments, an exception in the tool).
        call_reward: the reward of a turn for each call that ran.
    """

    name: str = "tools"
    tools: Sequence[Tool] = field(default_factory=tuple)
    malformed_reward: float = -0.1
    call_reward: float = 0.0

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The OpenAI ``tools`` entries of :attr:`tools` (what a :class:`Task` lists)."""
        return [t.schema() for t in self.tools]

    def step(self, task: Task, episode: Episode, turn: ModelTurn) -> EnvReply:
        """Run the turn's calls; a turn without one is the answer (``done``)."""
        calls = parse_tool_calls(turn.text)
        if not calls:
            return EnvReply(done=True)
        results = [run_tool_call(c, self.tools) for c in calls]
        failed = sum(not r.ok for r in results)
        episode.state["tool_calls"] = episode.state.get("tool_calls", 0) + len(results)
        episode.state["tool_errors"] = episode.state.get("tool_errors", 0) + failed
        reward = failed * self.malformed_reward + (len(results) - failed) * self.call_reward
        messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        return EnvReply(messages=messages, reward=reward)
