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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from rollhub.envs.episode.tools import Tool, parse_tool_calls, run_tool_call
from rollhub.envs.group.base import Mode
from rollhub.errors import ConfigError
from rollhub.inference.base import FinishReason

if TYPE_CHECKING:
    from rollhub.envs.episode.episode import Episode

Message = Mapping[str, Any]
Finish = Literal["done", "length", "budget", "max_turns", "abort", "abandoned"]
"""Why an episode ended: the environment said ``done``; a model turn was cut at its ``turn_max_tokens``
(``length``); the next turn or delta would not fit ``max_tokens`` (``budget``); ``max_turns`` model turns were
taken; a request was aborted (``abort``: the episode's whole task is left out, as for a single-turn group); a
gateway session's agent went away without finishing it (``abandoned``, :mod:`rollhub.gateway`)."""
TRUNCATED: frozenset[str] = frozenset({"length", "budget", "max_turns", "abandoned"})


@dataclass(frozen=True, slots=True)
class Task:
    """One task an episode starts from.

    Attributes:
        id: names the task in its group (``example_id``) and in each episode's id.
        messages: the first conversation (system and user messages).
        tools: OpenAI ``tools`` entries the chat template lists (``Tool.schema()``); empty for none.
        data: anything the environment needs to judge the task (the answer, a seed).
    """

    id: str
    messages: Sequence[Message]
    tools: Sequence[Message] = ()
    data: Any = None


@dataclass(frozen=True, slots=True)
class ModelTurn:
    """One sampled model turn as the environment sees it.

    Attributes:
        index: the turn's number in its episode, from 0.
        text: what the model wrote (special tokens left out).
        tokens: the ids it sampled.
        finish_reason: ``"stop"`` (its stop token), ``"length"`` (cut at the turn's token cap).
    """

    index: int
    text: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason


@dataclass(frozen=True, slots=True)
class EnvReply:
    """The environment's answer to a model turn.

    Attributes:
        messages: appended to the conversation before the next model turn (``tool`` or ``user`` messages).
        reward: this turn's reward (folded into the episode's score with the discount).
        done: the episode is over (``messages`` are then not rendered).
    """

    messages: Sequence[Message] = ()
    reward: float = 0.0
    done: bool = False


@dataclass(frozen=True, slots=True)
class Outcome:
    """The environment's judgement of a finished episode: its reward, and whether it solved the task."""

    reward: float
    correct: bool = False


@dataclass(frozen=True, slots=True)
class EpisodeLimits:
    """How long an episode may run.

    Attributes:
        max_tokens: the whole episode's token budget: the row a model turn is prompted with plus what it may
            sample never exceeds it, over all turns together (a turn is given at most what is left).
        turn_max_tokens: the most tokens one model turn may sample (a turn cut here ends its episode, flagged
            truncated).
        max_turns: the most model turns of an episode.
        discount: the per-turn discount of rewards in the episode's score (see the module docstring).
    """

    max_tokens: int = 1024
    turn_max_tokens: int = 256
    max_turns: int = 8
    discount: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.turn_max_tokens < 1 or self.max_turns < 1:
            raise ConfigError(f"episode limits must be >= 1 (got max_tokens={self.max_tokens}, "
                              f"turn_max_tokens={self.turn_max_tokens}, max_turns={self.max_turns})")  # fmt: skip
        if not 0.0 < self.discount <= 1.0:
            raise ConfigError(f"discount {self.discount} must be in (0, 1]")


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
