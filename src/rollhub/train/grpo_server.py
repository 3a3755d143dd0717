"""GRPO pulling from the buffer server: ``TrainerClient.get_batch`` -> staleness check -> step -> ack -> publish.

The server is the first staleness guard (``rollhub serve --max-staleness K`` serves nothing older than
``current_step - K``); this loop is the second: before training it counts every item whose ``policy_version``
is more than ``GRPOConfig.max_staleness`` steps behind the trainer and leaves it out (``GRPOTrainer.step``
drops the same items), and a batch with nothing fresh left is acknowledged and skipped, never trained on.

Batches are leased (``lease_s``): one the trainer dies on is served again; one it trained on, or skipped, is
acknowledged. Weights are published by the trainer's ``publish`` callback after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollhub.client.trainer import TrainerClient
from rollhub.client.types import Batch
from rollhub.train.grpo import GRPOTrainer


@dataclass(frozen=True, slots=True)
class PullConfig:
    """How batches are pulled.

    Attributes:
        wait_s: the longest one ``get_batch`` waits (server long-poll) before returning nothing.
        lease_s: the server serves a batch again unless it is acknowledged within this time.
    """

    wait_s: float = 5.0
    lease_s: float = 300.0


@dataclass(slots=True)
class PullCounters:
    """What the loop has seen so far.

    Attributes:
        batches: batches received from the server.
        trained: batches trained on.
        skipped: batches acknowledged without training (every item too stale).
        stale_items: items left out for staleness (in trained and skipped batches).
        empty_polls: ``get_batch`` calls that returned nothing within ``wait_s``.
        staleness: per trained item, ``trainer step - policy_version`` at the time of training.
    """

    batches: int = 0
    trained: int = 0
    skipped: int = 0
    stale_items: int = 0
    empty_polls: int = 0
    staleness: list[int] = field(default_factory=list)


class ServerGRPOLoop:
    """Trains a :class:`GRPOTrainer` on batches pulled from the buffer server.

    The trainer must already be registered with the server (``TrainerClient.register``) with a ``batch_size``
    counting sequences, as ``GRPOTrainer`` expects one batch per optimizer step.

    Args:
        trainer: the GRPO trainer (its ``config.max_staleness`` is the trainer-side bound).
        client: a registered trainer client.
        config: wait and lease times.
    """

    def __init__(self, trainer: GRPOTrainer, client: TrainerClient, config: PullConfig | None = None) -> None:
        self.trainer = trainer
        self.client = client
        self.config = config or PullConfig()
        self.counters = PullCounters()

    def stale(self, item: dict[str, Any]) -> bool:
        """Whether ``item`` is more than ``max_staleness`` steps behind the trainer (unversioned: never)."""
        version = item.get("policy_version")
        return version is not None and int(version) < self.trainer.step_count - self.trainer.config.max_staleness

    def step(self) -> dict[str, float] | None:
        """Pull one batch and train on it; None when no batch came within ``wait_s``.

        Returns:
            the trainer's metrics plus ``stale_items`` and ``max_item_staleness`` for this batch, or
            ``{"skipped": 1.0, "stale_items": n}`` for a batch with nothing fresh in it.
        """
        batch = self.client.get_batch(wait_s=self.config.wait_s, lease_s=self.config.lease_s)
        if batch is None:
            self.counters.empty_polls += 1
            return None
        self.counters.batches += 1
        items = list(batch)
        fresh = [it for it in items if not self.stale(it)]
        n_stale = len(items) - len(fresh)
        self.counters.stale_items += n_stale
        if not fresh:
            self._ack(batch)
            self.counters.skipped += 1
            return {"skipped": 1.0, "stale_items": float(n_stale)}
        ages = [
            self.trainer.step_count - int(it["policy_version"]) for it in fresh if it.get("policy_version") is not None
        ]
        stats = self.trainer.step(fresh)
        self._ack(batch)
        self.counters.trained += 1
        self.counters.staleness.extend(ages)
        stats.update(stale_items=float(n_stale), max_item_staleness=float(max(ages, default=0)))
        return stats

    def _ack(self, batch: Batch) -> None:
        if batch.batch_id is not None:
            self.client.ack(batch.batch_id)
