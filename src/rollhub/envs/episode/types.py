"""The data of a multi-turn episode: the task it starts from, the model's turns, the environment's replies, its
outcome, how it may end and how long it may run (see :mod:`rollhub.envs.episode.base` for the environment
protocol that exchanges them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rollhub.errors import ConfigError
from rollhub.inference.base import FinishReason

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
