"""The buffer's in-process values: its configuration, the trainer's run, a served batch, leases and counters."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

from rollhub.buffer.storage import Entry


@dataclass(frozen=True)
class BufferConfig:
    """Behaviour knobs of the buffer (all off by default, which is AtroposLib 0.4.0's behaviour).

    Attributes:
        max_staleness: serve no item whose ``policy_version`` is older than ``v - max_staleness``, where ``v`` is
            the latest published policy version (``current_step`` until the trainer publishes one); see
            :class:`rollhub.experience.StalenessPolicy`.
        max_queued_sequences: refuse new data (QueueFull, HTTP 429) that would take the waiting sequences
            past this bound; accepted data is never evicted.
        retry_after_s: the wait suggested to refused producers.
        stamp_unversioned: give a group that arrives without a ``policy_version`` (an Atropos environment's: its
            ``ScoredData`` has none) the version the staleness rule compares against at that moment, the trainer's
            latest published version (``current_step`` before any publish). The engine serving the environment
            held that version or an older one while it sampled, so the stamp is the newest version the group can
            be of: the staleness measured from it is a lower bound on the true one, and time spent queued counts.
            Off: such groups stay unversioned, never stale.
    """

    max_staleness: int | None = None
    max_queued_sequences: int | None = None
    retry_after_s: float = 1.0
    stamp_unversioned: bool = False


@dataclass(frozen=True)
class TrainerRun:
    """What the buffer needs to know of the trainer it serves (set by ``register_trainer``).

    Attributes:
        batch_size: sequences per batch (a batch is whole groups whose sizes add up to exactly this).
        starting_step: the trainer step of the first batch of a new run (a run already going keeps its step).
        max_token_len, wandb_group, wandb_project, checkpoint_dir, save_checkpoint_interval, num_steps: the
            run parameters an AtroposLib trainer registers, handed on to environments; unused by the buffer.
    """

    batch_size: int
    starting_step: int = 0
    max_token_len: int = -1
    wandb_group: str | None = None
    wandb_project: str | None = None
    checkpoint_dir: str = ""
    save_checkpoint_interval: int = 0
    num_steps: int = 2**31 - 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Batch:
    """One served batch. ``step`` is the trainer step it counts as; ``batch_id`` is set when leased."""

    items: list[Any]
    entries: list[Entry]
    step: int
    batch_id: str | None = None
    deadline: float | None = None

    @property
    def sequences(self) -> int:
        return sum(e.size for e in self.entries)


@dataclass
class Lease:
    """A served batch awaiting ``ack``: its items, the step it counts as, and when it expires (wall clock)."""

    entries: list[Entry]
    step: int
    deadline: float
    expired: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "deadline": self.deadline, "expired": self.expired}


@dataclass
class Counters:
    """Monotonic counters since process start (exported as metrics)."""

    groups_in: int = 0
    sequences_in: int = 0
    tokens_in: int = 0
    batches_out: int = 0
    sequences_out: int = 0
    refused_full: int = 0
    redelivered: int = 0
    serve_failures: int = 0  # batches formed but not delivered (encoding or storing failed): put back whole
    lease_expiries: int = 0
    env_registrations_waited: int = 0  # /register-env answered 'wait for trainer to start'
    stale_dropped: dict[str, int] = field(default_factory=dict)
    # per env_id (None: groups posted without one): [groups, sequences]
    ingested_by_env: dict[int | None, list[int]] = field(default_factory=dict)
    served_by_env: dict[int | None, list[int]] = field(default_factory=dict)

    def copy(self) -> Counters:
        """An independent copy (the per-env rows too), cheap enough to take on every poll."""
        out = copy.copy(self)
        out.stale_dropped = dict(self.stale_dropped)
        out.ingested_by_env = {k: list(v) for k, v in self.ingested_by_env.items()}
        out.served_by_env = {k: list(v) for k, v in self.served_by_env.items()}
        return out

    def count_stale(self, entries: list[Entry]) -> None:
        """Items dropped as too stale, per env (keyed by ``str(env_id)``, as persisted)."""
        for e in entries:
            key = str(e.env_id)
            self.stale_dropped[key] = self.stale_dropped.get(key, 0) + 1

    def count_ingested(self, env_id: int | None, sequences: int) -> None:
        """One group (or item) of ``sequences`` accepted for ``env_id``."""
        row = self.ingested_by_env.setdefault(env_id, [0, 0])
        row[0] += 1
        row[1] += sequences

    def count_served(self, entries: list[Entry]) -> None:
        """The groups of one served batch, per env (redeliveries count again, like ``sequences_out``)."""
        for e in entries:
            row = self.served_by_env.setdefault(e.env_id, [0, 0])
            row[0] += 1
            row[1] += e.size
