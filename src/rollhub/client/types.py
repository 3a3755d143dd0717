"""Plain values the clients return (in-process types, not wire models)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from rollhub.experience import Group


@dataclass(frozen=True)
class ServerInfo:
    """``GET /info``: the trainer's batch size (in sequences) and max token length; -1 before registration."""

    batch_size: int
    max_token_len: int


@dataclass(frozen=True)
class StepAndQueue:
    """What both status answers (``GET /status``, ``GET /status-env``) begin with, as AtroposLib 0.4.0's do.

    Attributes:
        current_step: the trainer step.
        queue_size: queued work (see each answer for its unit).
    """

    current_step: int
    queue_size: int


@dataclass(frozen=True)
class QueueStatus(StepAndQueue):
    """``GET /status``: the trainer step and the number of queued groups (``raw`` keeps every field sent).

    ``policy_version`` is the last version the trainer published (``POST /policy-version``); None before the
    first publish and on servers without that route. ``next_batch_version`` is the version the trainer will train
    the next batch served at (``policy_version``, plus one once a batch was served since it was published); None
    where ``policy_version`` is, and on servers that do not report it.
    """

    policy_version: int | None = None
    next_batch_version: int | None = None
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
class EnvStatus(StepAndQueue):
    """``GET /status-env`` for one env.

    Attributes:
        current_step: the trainer step.
        queue_size: queued work that competes with this env, in units of this env's group size.
        env_weight: this env's share of sampling weight among connected envs.
        self_queue_size: this env's own queued groups, when the server reports it.
    """

    env_weight: float
    self_queue_size: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class PublishedVersion:
    """A successful ``POST /policy-version``.

    Attributes:
        policy_version: the version the server now holds (the one published).
        stale_dropped: queued items the staleness bound dropped because of this publish.
    """

    policy_version: int
    stale_dropped: int
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Batch(Sequence[Group]):
    """One served batch: a sequence of :class:`~rollhub.experience.Group` objects, whatever the transport.

    A group keeps its per-token fields as :class:`~rollhub.experience.Ragged` numpy buffers (``group.tokens.rows()``
    gives one array per sequence), its scores as a float64 array, and ``env_id``, ``policy_version`` and the
    small optional fields (``group.meta``) as served; :func:`rollhub.wire.group.group_to_item` gives the ScoredData
    dict.

    Attributes:
        groups: the groups, oldest first as the server formed them.
        batch_id: set when the batch was leased; pass it to ``ack`` once trained on.
        step: the trainer step this batch counts as, when the server reports it.
    """

    groups: list[Group]
    batch_id: str | None = None
    step: int | None = None

    @overload
    def __getitem__(self, i: int) -> Group: ...
    @overload
    def __getitem__(self, i: slice) -> list[Group]: ...
    def __getitem__(self, i: int | slice) -> Group | list[Group]:
        return self.groups[i]

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[Group]:
        return iter(self.groups)

    @property
    def sequences(self) -> int:
        """Number of sequences in the batch (what the trainer's ``batch_size`` counts)."""
        return sum(g.size for g in self.groups)
