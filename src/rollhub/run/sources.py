"""Where a run's trainer gets its batches: the sources that join a trainer to the fleet or the buffer server.

GRPO groups (each implements :class:`rollhub.train.grpo.GroupSource` for :func:`rollhub.train.grpo.train_grpo`):

- :class:`ServerGroupSource` pulls leased batches through ``TrainerClient.get_batch`` (a batch the trainer
  dies on is served again after ``lease_s``), acknowledges each batch once trained on or skipped, and announces
  every published version to the buffer (``POST /policy-version``), so the buffer's staleness bound counts the
  same versions as the trainer and the workers. The server is the first staleness guard
  (``rollhub serve --max-staleness K``); the loop's :class:`~rollhub.experience.StalenessPolicy` is the second.
- :class:`InProcessGroupSource` plays the rollout worker in this process: when its :class:`GroupQueue` holds
  less than a batch it syncs the newest weights into a local
  :class:`~rollhub.rollout.group.manager.GroupRolloutManager`, draws a lesson from the run's curriculum
  (:class:`~rollhub.rollout.group.lessons.LessonPlan`), samples it with the loaded ``policy_version`` and queues the
  groups, exactly what a worker would write to the server.

Step fragments (each implements :class:`rollhub.train.sources.FragmentSource` for the PPO learner):
:class:`RayReplaySource` reads a replay-buffer actor, :class:`LocalReplaySource` a replay buffer in this process;
both check the fleet feeding them whenever no batch comes, so a fleet that cannot produce raises instead of
leaving the trainer waiting.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from rollhub.client.errors import RequestRejected
from rollhub.client.trainer import TrainerClient
from rollhub.client.types import Batch
from rollhub.curriculum.shared import CurriculumLike
from rollhub.experience import Group, SampleFragment
from rollhub.rollout.group.lessons import LessonPlan
from rollhub.rollout.group.manager import GroupRolloutManager
from rollhub.rollout.protocols import Fleet
from rollhub.train.grpo import TrainingError

logger = logging.getLogger(__name__)


class ServerGroupSource:
    """Leased batches from the buffer server through a registered :class:`TrainerClient`.

    The client must already be registered with a ``batch_size`` counting sequences (one batch per optimizer
    update).

    Args:
        client: a registered trainer client.
        lease_s: the server serves a batch again unless it is acknowledged within this time.
        on_empty: called whenever no batch came within ``wait_s`` (a fleet's liveness check, which raises when
            the producers are gone, so the trainer never waits on a dead pipeline).
    """

    def __init__(self, client: TrainerClient, lease_s: float = 300.0,
                 on_empty: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.client = client
        self.lease_s = lease_s
        self.on_empty = on_empty
        self.empty_polls = 0
        self._pending: Batch | None = None
        self._announcing = True

    def next_batch(self, wait_s: float) -> list[Group] | None:
        """One leased batch's groups, or ``None`` when none came within ``wait_s`` (server long-poll)."""
        batch = self.client.get_batch(wait_s=wait_s, lease_s=self.lease_s)
        if batch is None:
            self.empty_polls += 1
            if self.on_empty is not None:
                self.on_empty()
            return None
        self._pending = batch
        return list(batch)

    def ack(self) -> None:
        """Acknowledge the batch served last (it is never served again)."""
        batch, self._pending = self._pending, None
        if batch is not None and batch.batch_id is not None:
            self.client.ack(batch.batch_id)

    def publish_version(self, version: int) -> None:
        """Tell the buffer the version just published (a server without the route, such as AtroposLib 0.4.0,
        keeps its own ``current_step`` clock: that is said once and the source stops announcing)."""
        if not self._announcing:
            return
        try:
            self.client.publish_version(version)
        except RequestRejected as exc:
            if exc.status_code not in (404, 405):
                raise
            self._announcing = False
            logger.warning("the server has no POST /policy-version (%s); its staleness bound uses current_step", exc)


class GroupQueue:
    """An in-process stand-in for the buffer server: producers ``put`` groups, the trainer takes batches.

    ``next_batch`` returns whole groups totalling at least ``batch_size`` sequences, oldest first, or None
    when fewer are queued, which is the contract of ``GET /batch``.

    Args:
        batch_size: sequences (completions, summed over groups) per batch.
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self._groups: deque[Group] = deque()
        self._queued = 0

    def put(self, groups: list[Group]) -> None:
        """Queue groups, as ``POST /scored_data_list`` would."""
        self._groups.extend(groups)
        self._queued += sum(g.size for g in groups)

    def next_batch(self) -> list[Group] | None:
        """The oldest whole groups reaching ``batch_size`` sequences, or None (see the class docstring)."""
        if self._queued < self.batch_size:
            return None
        out, n = [], 0
        while n < self.batch_size:
            group = self._groups.popleft()
            out.append(group)
            n += group.size
        self._queued -= n
        return out


class InProcessGroupSource:
    """Batches produced on demand in this process by one rollout manager (see the module docstring).

    Args:
        manager: samples groups with its own policy copy.
        curriculum: the run's curriculum (lessons drawn from it, statistics reported to it).
        batch_size: sequences per batch.
        seed: the run's seed (the lesson plan's random stream).
        worker_id: how groups name their producer.
    """

    def __init__(self, manager: GroupRolloutManager, curriculum: CurriculumLike, batch_size: int, seed: int = 0,
                 worker_id: str = "local-0") -> None:  # fmt: skip
        self.manager = manager
        self.queue = GroupQueue(batch_size)
        self.plan = LessonPlan(curriculum, worker_id, seed)
        self.worker_id = worker_id
        self.loaded_version = 0
        self.turns = 0
        self.max_empty_turns = 100
        self._pending: tuple[int, Mapping[str, Any] | None] | None = None

    def offer_weights(self, version: int, weights: Mapping[str, Any]) -> None:
        """The trainer published ``version``; it is loaded before the next sampling turn."""
        self._pending = (version, weights)

    def offer_version(self, version: int, weights: Mapping[str, Any] | None = None) -> None:
        """The trainer published ``version`` where the manager's policy already reads it (an inference engine
        it was pushed into): groups sampled from the next turn on are tagged with it, nothing is loaded."""
        self._pending = (version, None)

    def next_batch(self, wait_s: float) -> list[Group] | None:
        """Sample turns until the queue holds a batch (``wait_s`` is not needed: sampling here is the wait)."""
        empty = 0
        while (groups := self.queue.next_batch()) is None:
            empty = 0 if self._turn() else empty + 1
            if empty >= self.max_empty_turns:
                raise TrainingError(
                    f"{empty} sampling turns in a row produced no groups; check that the environment's sample() "
                    "returns groups in mode 'train'"
                )
        return groups

    def _turn(self) -> int:
        if self._pending is not None:
            self.loaded_version, weights = self._pending
            if weights is not None:
                self.manager.update_model(weights)
            self._pending = None
        produced: list[Group] = []
        for kind, request in self.plan.plan(self.turns, self.loaded_version, self.worker_id, None):
            result = self.manager.sample_batch(request)
            self.plan.report(kind, request, result, self.turns)
            if kind == "train":
                produced = [g for g in result.items if isinstance(g, Group)]
                self.queue.put(produced)
        self.turns += 1
        return len(produced)

    def ack(self) -> None:
        """Nothing to do: a queued batch is handed out once."""

    def publish_version(self, version: int) -> None:
        """Nothing to do: the queue holds only groups sampled with published weights (no bound to move)."""


class _FleetFedSource:
    """A replay buffer fed by a fleet: ``None`` after ``wait_s`` makes it check the fleet, so a fleet that
    cannot produce raises ``FleetError`` instead of leaving the trainer waiting."""

    def __init__(self, fleet: Fleet | None) -> None:
        self.fleet = fleet

    def _serve(self, wait_s: float) -> Any:
        raise NotImplementedError

    def next_batch(self, wait_s: float) -> list[SampleFragment] | None:
        """One served batch's fragments, or ``None`` after ``wait_s`` (then the fleet is checked)."""
        batch = self._serve(wait_s)
        if batch is None:
            if self.fleet is not None:
                self.fleet.check()
            return None
        return list(batch.items)


class RayReplaySource(_FleetFedSource):
    """Batches from a :class:`rollhub.rollout.replay.ReplayBuffer` actor fed by a rollout fleet.

    Args:
        replay: the replay-buffer actor handle.
        fleet: the :class:`rollhub.rollout.backends.ray.FleetClient` feeding it; checked whenever no batch comes, so a
            fleet that cannot produce raises ``FleetError`` here.
        timeout_s: how much longer than ``wait_s`` a call may take before Ray's timeout error propagates.
    """

    def __init__(self, replay: Any, fleet: Fleet | None = None, timeout_s: float = 60.0) -> None:
        super().__init__(fleet)
        self.replay = replay
        self.timeout_s = timeout_s

    def _serve(self, wait_s: float) -> Any:
        import ray

        return ray.get(self.replay.next_batch.remote(wait_s), timeout=wait_s + self.timeout_s)

    def publish_version(self, version: int) -> None:
        """Tell the replay buffer the trainer's version and wait for it to take it (the actor runs calls
        concurrently, so only waiting orders it before this trainer's next ``next_batch``)."""
        import ray

        ray.get(self.replay.publish_version.remote(version), timeout=self.timeout_s)


class LocalReplaySource(_FleetFedSource):
    """Batches from a :class:`rollhub.rollout.replay.ReplayBuffer` in this process, fed by a
    :class:`rollhub.rollout.backends.local.LocalFleet` (checked whenever no batch comes, as above).

    Args:
        replay: the buffer.
        fleet: the fleet feeding it, or ``None``.
    """

    def __init__(self, replay: Any, fleet: Fleet | None = None) -> None:
        super().__init__(fleet)
        self.replay = replay

    def _serve(self, wait_s: float) -> Any:
        return self.replay.next_batch(wait_s)

    def publish_version(self, version: int) -> None:
        """The trainer now holds ``version`` (the buffer's staleness bound compares against it from now on)."""
        self.replay.publish_version(version)
