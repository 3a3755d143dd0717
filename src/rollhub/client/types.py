"""Plain values the clients return (in-process types, not wire models)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload


@dataclass(frozen=True)
class ServerInfo:
    """``GET /info``: the trainer's batch size (in sequences) and max token length; -1 before registration."""

    batch_size: int
    max_token_len: int


@dataclass(frozen=True)
class QueueStatus:
    """``GET /status``: the trainer step and the number of queued groups (``raw`` keeps every field sent)."""

    current_step: int
    queue_size: int
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class EnvRegistration:
    """A successful ``POST /register-env``: the env's id and its unique W&B run name."""

    env_id: int
    wandb_name: str
    starting_step: int
    checkpoint_dir: str
    checkpoint_interval: int
    num_steps: int
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class EnvStatus:
    """``GET /status-env`` for one env.

    Attributes:
        current_step: the trainer step.
        queue_size: queued work that competes with this env, in units of this env's group size.
        env_weight: this env's share of sampling weight among connected envs.
        self_queue_size: this env's own queued groups, when the server reports it.
    """

    current_step: int
    queue_size: int
    env_weight: float
    self_queue_size: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Batch(Sequence[dict[str, Any]]):
    """One served batch: a sequence of groups, each a dict with the 14 ScoredData keys.

    Per-token fields (``tokens``, ``masks``, log-probs) are sequences of rows: numpy arrays when the batch
    came as msgpack, lists when it came as JSON; ``np.asarray(row)`` works for both.

    Attributes:
        groups: the groups, oldest first as the server formed them.
        batch_id: set when the batch was leased; pass it to ``ack`` once trained on.
        step: the trainer step this batch counts as, when the server reports it.
    """

    groups: list[dict[str, Any]]
    batch_id: str | None = None
    step: int | None = None

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        return self.groups[i]

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.groups)

    @property
    def sequences(self) -> int:
        """Number of sequences in the batch (what ``batch_size`` counts)."""
        return sum(len(g["tokens"]) for g in self.groups)
