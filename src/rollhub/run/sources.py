"""Where a run's trainer gets its batches: the sources that join a trainer to the fleet or the buffer server.

GRPO groups (each implements :class:`rollhub.train.grpo.GroupSource` for :func:`rollhub.train.grpo.train_grpo`),
served as one type, :class:`rollhub.client.types.Batch` (a ``Sequence[Group]``):

- :class:`ServerGroupSource` pulls leased batches through ``TrainerClient.get_batch`` (a batch the trainer
  dies on is served again after ``lease_s``), acknowledges each batch once trained on, and announces
  every published version to the buffer (``POST /policy-version``), so the buffer's staleness bound counts the
  same versions as the trainer and the workers.
- :class:`InProcessGroupSource` plays the rollout worker in this process: when its :class:`GroupQueue` holds
  less than a batch it syncs the newest weights into a local
  :class:`~rollhub.rollout.group.manager.GroupRolloutManager`, draws a lesson from the run's curriculum
  (:class:`~rollhub.rollout.group.lessons.LessonPlan`), samples it with the loaded ``policy_version`` and queues the
  groups, exactly what a worker would write to the server.

Step fragments (each implements :class:`rollhub.train.sources.FragmentSource` for the PPO learner):
:class:`RayReplaySource` reads a replay-buffer actor, :class:`LocalReplaySource` a replay buffer in this process;
both hand out the fragments of the table's served :class:`rollhub.buffer.Batch` as they are, and check the fleet
feeding them whenever no batch comes, so a fleet that cannot produce raises instead of leaving the trainer waiting.

Staleness is applied once per path, before a batch reaches the trainer (which trains on every batch served):

- the replay buffer's own guard on the step path (its ``max_staleness``, against the versions the source
  publishes to it), after the workers' admission;
- the buffer server's guard (``rollhub serve --max-staleness K``, which ``rollhub run`` always sets on the server
  it starts) on the group path over HTTP, after the workers' admission. Only when the server has no guard of that
  bound (an AtroposLib server, which has no ``POST /policy-version``; a server at ``writer.url`` started without
  ``--max-staleness`` or with a looser one) does :class:`ServerGroupSource` apply the bound itself, once, to each
  batch it serves, counting the groups it leaves out;
- the in-process queue's guard (:class:`GroupQueue`) on the in-process group path, where groups are sampled with
  the trainer's newest weights and so are at most one version old unless a sampling turn made more than a batch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollhub.client.errors import RequestRejected
from rollhub.client.trainer import TrainerClient
from rollhub.client.types import Batch
from rollhub.curriculum.shared import CurriculumLike
from rollhub.experience import Group, SampleFragment, StalenessPolicy
from rollhub.experience.episodes import episode_count
from rollhub.rollout.group.lessons import LessonPlan
from rollhub.rollout.group.manager import GroupRolloutManager
from rollhub.rollout.protocols import Fleet
from rollhub.train.grpo import GroupSource, TrainingError

logger = logging.getLogger(__name__)


class ServerGroupSource:
    """Leased batches from the buffer server through a registered :class:`TrainerClient`.

    The client must already be registered with a ``batch_size`` counting sequences (one batch per optimizer
    update). Batches are served as the client returns them (:class:`rollhub.client.types.Batch`). Where the
    server guards the bound (its ``GET /status`` reports a ``max_staleness`` no looser than this source's), this
    source applies no staleness bound. Where it does not (no ``POST /policy-version``, as on an AtroposLib server,
    or no bound, or a looser one; found out at the first :meth:`publish_version` and logged as a warning), this
    source leaves out of each batch the groups more than ``max_staleness`` versions behind the version it was
    last told, counts them in ``stale_groups``, and acknowledges a batch with nothing left without handing it out
    (``batches_skipped``).

    Args:
        client: a registered trainer client.
        lease_s: the server serves a batch again unless it is acknowledged within this time.
        on_empty: called whenever no batch came within ``wait_s`` (a fleet's liveness check, which raises when
            the producers are gone, so the trainer never waits on a dead pipeline).
        max_staleness: the run's bound (``writer.max_staleness``), applied here only where the server has no guard
            of it (``None``: no bound).
    """

    def __init__(self, client: TrainerClient, lease_s: float = 300.0,
                 on_empty: Callable[[], None] | None = None, max_staleness: int | None = None) -> None:  # fmt: skip
        self.client = client
        self.lease_s = lease_s
        self.on_empty = on_empty
        self.staleness = StalenessPolicy(max_staleness)
        self.empty_polls = 0
        self.stale_groups = 0
        self.batches_skipped = 0
        self.version = 0
        self.guarded: bool | None = None  # whether the server applies the bound; known after the first publish
        self._pending: Batch | None = None
        self._announcing = True

    def next_batch(self, wait_s: float) -> Batch | None:
        """One leased batch, or ``None`` when none came within ``wait_s`` (server long-poll) or the one that came
        was too stale as a whole (only where this source applies the bound; it is acknowledged and counted)."""
        batch = self.client.get_batch(wait_s=wait_s, lease_s=self.lease_s)
        if batch is None:
            self.empty_polls += 1
            if self.on_empty is not None:
                self.on_empty()
            return None
        if not self.guarded and self.staleness.bounded:
            batch = self._bounded(batch)
        self._pending = batch
        return batch

    def _bounded(self, batch: Batch) -> Batch | None:
        """``batch`` without the groups too stale at ``version`` (the one application of the bound on this path)."""
        kept = [g for g in batch if not self.staleness.is_stale(g.policy_version, self.version)]
        if len(kept) == len(batch):
            return batch
        self.stale_groups += len(batch) - len(kept)
        if kept:
            return Batch(kept, batch.batch_id, batch.step)
        self.batches_skipped += 1
        if batch.batch_id is not None:
            self.client.ack(batch.batch_id)
        return None

    def ack(self) -> None:
        """Acknowledge the batch served last (it is never served again)."""
        batch, self._pending = self._pending, None
        if batch is not None and batch.batch_id is not None:
            self.client.ack(batch.batch_id)

    def publish_version(self, version: int) -> None:
        """Tell the buffer the version just published (a server without the route, such as AtroposLib 0.4.0,
        keeps its own ``current_step`` clock: that is said once and the source stops announcing). The first call
        also finds out whether the server guards the bound (see the class docstring)."""
        self.version = version
        if self._announcing:
            try:
                self.client.publish_version(version)
            except RequestRejected as exc:
                if exc.status_code not in (404, 405):
                    raise
                self._announcing = False
                logger.warning(
                    "the server has no POST /policy-version (%s); its own clock is current_step, so the trainer's "
                    "source applies the staleness bound (%s versions) to the batches it serves",
                    exc,
                    self.staleness.max_staleness,
                )
        if self.guarded is None:
            self.guarded = self._server_guards()

    def _server_guards(self) -> bool:
        """Whether the server applies this source's bound or a tighter one against the announced versions."""
        if not self._announcing:
            return False
        bound = self.staleness.max_staleness
        if bound is None:
            return True  # nothing to apply
        served = self.client.status().raw.get("max_staleness")
        if isinstance(served, int) and served <= bound:
            return True
        logger.warning(
            "the server's staleness bound is %s (GET /status max_staleness); the trainer's source applies the "
            "run's bound of %d versions to the batches it serves",
            served,
            bound,
        )
        return False


class GroupQueue:
    """An in-process stand-in for the buffer server: producers ``put`` groups, the trainer takes batches.

    ``next_batch`` returns whole groups totalling at least ``batch_size`` sequences, oldest first, or None
    when fewer are queued, which is the contract of ``GET /batch``; as there, a group of multi-turn episodes counts
    its episodes, not its rows (:func:`~rollhub.experience.episodes.episode_count`). Like the server, the queue
    guards the staleness bound: :meth:`publish_version` drops queued groups more than ``max_staleness`` versions
    behind the published version and counts them in ``stale_dropped``.

    Args:
        batch_size: sequences (completions, summed over groups) per batch.
        max_staleness: the bound (``None``: none).
    """

    def __init__(self, batch_size: int, max_staleness: int | None = None) -> None:
        self.batch_size = batch_size
        self.staleness = StalenessPolicy(max_staleness)
        self.stale_dropped = 0
        self._groups: deque[Group] = deque()
        self._queued = 0

    def put(self, groups: list[Group]) -> None:
        """Queue groups, as ``POST /scored_data_list`` would."""
        self._groups.extend(groups)
        self._queued += sum(episode_count(g) for g in groups)

    def next_batch(self) -> Batch | None:
        """The oldest whole groups reaching ``batch_size`` sequences, or None (see the class docstring)."""
        if self._queued < self.batch_size:
            return None
        out, n = [], 0
        while n < self.batch_size:
            group = self._groups.popleft()
            out.append(group)
            n += episode_count(group)
        self._queued -= n
        return Batch(out)

    def publish_version(self, version: int) -> None:
        """The trainer holds ``version``: queued groups too stale at it are dropped, as ``POST /policy-version``
        makes the server drop them."""
        if not self.staleness.bounded:
            return
        kept = deque(g for g in self._groups if not self.staleness.is_stale(g.policy_version, version))
        self.stale_dropped += len(self._groups) - len(kept)
        self._groups, self._queued = kept, sum(episode_count(g) for g in kept)


class InProcessGroupSource:
    """Batches produced on demand in this process by one rollout manager (see the module docstring).

    Batches are served as :class:`rollhub.client.types.Batch`, the type :class:`ServerGroupSource` serves. Groups
    are sampled with the weights the trainer published last, so they are fresh by construction; a group left
    queued from an earlier turn is subject to the queue's guard (:class:`GroupQueue`), whose drops are counted in
    ``stale_groups``. The source itself applies no bound.

    Args:
        manager: samples groups with its own policy copy.
        curriculum: the run's curriculum (lessons drawn from it, statistics reported to it).
        batch_size: sequences per batch.
        seed: the run's seed (the lesson plan's random stream).
        worker_id: how groups name their producer.
        max_staleness: the queue's bound (``writer.max_staleness``; ``None``: none).
    """

    batches_skipped = 0  # the queue serves only whole batches of groups it kept

    def __init__(self, manager: GroupRolloutManager, curriculum: CurriculumLike, batch_size: int, seed: int = 0,
                 worker_id: str = "local-0", max_staleness: int | None = None) -> None:  # fmt: skip
        self.manager = manager
        self.queue = GroupQueue(batch_size, max_staleness)
        self.plan = LessonPlan(curriculum, worker_id, seed)
        self.worker_id = worker_id
        self.loaded_version = 0
        self.turns = 0
        self.max_empty_turns = 100
        self._pending: tuple[int, Mapping[str, Any] | None] | None = None

    @property
    def stale_groups(self) -> int:
        """Groups the queue dropped as too stale."""
        return self.queue.stale_dropped

    def offer_weights(self, version: int, weights: Mapping[str, Any]) -> None:
        """The trainer published ``version``; it is loaded before the next sampling turn."""
        self._pending = (version, weights)

    def offer_version(self, version: int, weights: Mapping[str, Any] | None = None) -> None:
        """The trainer published ``version`` where the manager's policy already reads it (an inference engine
        it was pushed into): groups sampled from the next turn on are tagged with it, nothing is loaded."""
        self._pending = (version, None)

    def next_batch(self, wait_s: float) -> Batch | None:
        """Sample turns until the queue holds a batch (``wait_s`` is not needed: sampling here is the wait)."""
        empty = 0
        while (batch := self.queue.next_batch()) is None:
            empty = 0 if self._turn() else empty + 1
            if empty >= self.max_empty_turns:
                raise TrainingError(
                    f"{empty} sampling turns in a row produced no groups; check that the environment's sample() "
                    "returns groups in mode 'train'"
                )
        return batch

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
        """The trainer holds ``version``: the queue's guard compares against it."""
        self.queue.publish_version(version)


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


class SourceTap:
    """A group source that serves another source's batches unchanged and looks at each one on its way
    (:meth:`saw`); everything else passes through. Subclasses override :meth:`saw`."""

    def __init__(self, source: GroupSource) -> None:
        self.source = source

    @property
    def stale_groups(self) -> int:
        return self.source.stale_groups

    @property
    def batches_skipped(self) -> int:
        return self.source.batches_skipped

    def next_batch(self, wait_s: float) -> Sequence[Group] | None:
        """The source's next batch, after :meth:`saw` looked at it."""
        batch = self.source.next_batch(wait_s)
        if batch:
            self.saw(batch)
        return batch

    def saw(self, batch: Sequence[Group]) -> None:
        """Look at a batch about to be served (nothing here)."""

    def ack(self) -> None:
        """Acknowledge through the source."""
        self.source.ack()

    def publish_version(self, version: int) -> None:
        """Announce through the source."""
        self.source.publish_version(version)
