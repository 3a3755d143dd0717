"""GRPO pulling from the buffer server: ``TrainerClient.get_batch`` -> staleness check -> step -> ack -> publish.

The server is the first staleness guard (``rollhub serve --max-staleness K`` serves nothing older than its
current version minus ``K``); this loop is the second: before training it counts every group the trainer's
:class:`~rollhub.experience.StalenessPolicy` rejects at the trainer's policy version and leaves it out
(``GRPOTrainer.step`` drops the same groups), and a batch with nothing fresh left is acknowledged and
skipped, never trained on; a skipped batch changes no version.

Batches are leased (``lease_s``): one the trainer dies on is served again; one it trained on, or skipped, is
acknowledged. Weights are published by the trainer's ``publish`` callback after every update; then the new
version is announced to the buffer (``TrainerClient.publish_version``), so the buffer's staleness bound
counts the same versions as the trainer and the workers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from rollhub.client.errors import RequestRejected
from rollhub.client.trainer import TrainerClient
from rollhub.client.types import Batch
from rollhub.experience import Group
from rollhub.train.grpo import GRPOTrainer

logger = logging.getLogger(__name__)


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
        skipped: batches acknowledged without training (every group too stale).
        stale_groups: groups left out for staleness (in trained and skipped batches).
        empty_polls: ``get_batch`` calls that returned nothing within ``wait_s``.
        staleness: per trained group, ``trainer version - policy_version`` at the time of training.
    """

    batches: int = 0
    trained: int = 0
    skipped: int = 0
    stale_groups: int = 0
    empty_polls: int = 0
    staleness: list[int] = field(default_factory=list)


class ServerGRPOLoop:
    """Trains a :class:`GRPOTrainer` on batches pulled from the buffer server.

    The trainer must already be registered with the server (``TrainerClient.register``) with a ``batch_size``
    counting sequences, as ``GRPOTrainer`` expects one batch per optimizer update.

    Args:
        trainer: the GRPO trainer (its staleness policy is the trainer-side bound).
        client: a registered trainer client.
        config: wait and lease times.
    """

    def __init__(self, trainer: GRPOTrainer, client: TrainerClient, config: PullConfig | None = None) -> None:
        self.trainer = trainer
        self.client = client
        self.config = config or PullConfig()
        self.counters = PullCounters()
        self._announcing = True

    def stale(self, group: Group) -> bool:
        """Whether the trainer's staleness policy rejects ``group`` at its current version."""
        return self.trainer.staleness.is_stale(group.policy_version, self.trainer.policy_version)

    def step(self) -> dict[str, float] | None:
        """Pull one batch and train on it; None when no batch came within ``wait_s``.

        Returns:
            the trainer's metrics plus ``stale_groups`` and ``max_group_staleness`` for this batch, or
            ``{"skipped": 1.0, "stale_groups": n}`` for a batch with nothing fresh in it.
        """
        batch = self.client.get_batch(wait_s=self.config.wait_s, lease_s=self.config.lease_s)
        if batch is None:
            self.counters.empty_polls += 1
            return None
        self.counters.batches += 1
        groups = list(batch)
        fresh = [g for g in groups if not self.stale(g)]
        n_stale = len(groups) - len(fresh)
        self.counters.stale_groups += n_stale
        if not fresh:
            self._ack(batch)
            self.counters.skipped += 1
            return {"skipped": 1.0, "stale_groups": float(n_stale)}
        version = self.trainer.policy_version
        ages = [self.trainer.staleness.lag(g.policy_version, version) for g in fresh if g.policy_version is not None]
        stats = self.trainer.step(fresh)
        self._ack(batch)
        self._announce(self.trainer.policy_version)
        self.counters.trained += 1
        self.counters.staleness.extend(ages)
        stats.update(stale_groups=float(n_stale), max_group_staleness=float(max(ages, default=0)))
        return stats

    def _announce(self, version: int) -> None:
        """Tell the buffer the version just published (a server without the route, such as AtroposLib 0.4.0,
        keeps its own ``current_step`` clock: that is said once and the loop stops announcing)."""
        if not self._announcing:
            return
        try:
            self.client.publish_version(version)
        except RequestRejected as exc:
            if exc.status_code not in (404, 405):
                raise
            self._announcing = False
            logger.warning("the server has no POST /policy-version (%s); its staleness bound uses current_step", exc)

    def _ack(self, batch: Batch) -> None:
        if batch.batch_id is not None:
            self.client.ack(batch.batch_id)
