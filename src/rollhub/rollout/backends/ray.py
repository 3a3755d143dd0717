"""The Ray backend: the fleet, its workers and the replay buffer as Ray actors, for one machine or a cluster.

:class:`RolloutFleet` is the Ray actor that creates, feeds and supervises RolloutWorker actors
(:class:`RayRolloutWorker`).

The fleet owns the ``EpisodeStatistics`` actor and, on the group path, the run's one curriculum actor that every
worker (replacements included) samples lessons from and reports to; it forwards every weight version to all workers
as one object reference (one ``ray.put`` by the trainer, one ``ray.get`` per worker), and restarts a worker that
died or failed, handing the replacement the newest weights. Workers are spread over the cluster's nodes (Ray's
``SPREAD`` strategy, optionally restricted to nodes offering ``FleetConfig.worker_resources``); a worker whose node
is lost is replaced on a node that is still alive. The fleet and its statistics actor stay on the node of the
process that started the fleet (the trainer's), so losing any other node costs only the workers on it. The trainer
talks to it through :class:`FleetClient`, which turns a dead or unresponsive fleet into a :class:`FleetError`
instead of a hang. The workers write with :class:`ActorWriter` into the replay-buffer actor of
:func:`start_replay_buffer`.

This is the only part of the rollout package that imports Ray; the local and process fleets run without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollhub.curriculum.actor import RemoteCurriculum, start_curriculum_actor
from rollhub.curriculum.config import CurriculumConfig
from rollhub.errors import ConfigError, RollhubError
from rollhub.rollout.backends.base import FleetConfig, FleetError, raise_if_cannot_produce, slots_problem
from rollhub.rollout.protocols import ExperienceWriter, RolloutManager
from rollhub.rollout.replay import ReplayBuffer
from rollhub.rollout.stats import EpisodeStatistics, fleet_status
from rollhub.rollout.worker import RolloutWorker
from rollhub.weights.ray_transport import RayWeightPublisher, RayWeightSubscriber


class RayRolloutWorker(RolloutWorker):
    """The :class:`RolloutWorker` the Ray fleet runs as an actor: offered weights are object references (fetched
    when the worker next polls), and ``info`` names the Ray node it runs on."""

    def _offered_weights(self) -> RayWeightSubscriber:
        return RayWeightSubscriber()

    def _node_id(self) -> str | None:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


class ActorWriter:
    """Writes items to a Ray actor exposing ``add(items: list) -> Any``.

    Args:
        actor: the actor handle (picklable, so the writer can be shipped to a worker actor).
        timeout_s: how long one ``add`` may take before ``ray.exceptions.GetTimeoutError``.
    """

    def __init__(self, actor: Any, timeout_s: float = 60.0) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    def write(self, items: list[Any]) -> None:
        """Add ``items`` and wait for the actor to accept them.

        Raises:
            RollhubError: what the actor raised (e.g. ``QueueFull``; retry after ``retry_after_s``).
        """
        try:
            ray.get(self.actor.add.remote(items), timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, RollhubError):
                raise exc.cause from None
            raise

    def close(self) -> None:
        """Nothing is buffered locally."""


_RemoteWorker = ray.remote(RayRolloutWorker)
_RemoteStatistics = ray.remote(EpisodeStatistics)


class RemoteStatistics:
    """The fleet's ``EpisodeStatistics`` actor behind the plain ``record`` / ``history`` calls workers and the
    trainer make (picklable: it travels to every worker).

    Args:
        handle: the actor handle.
        timeout_s: how long ``history`` waits for the actor.
    """

    def __init__(self, handle: Any, timeout_s: float = 60.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    def record(self, episodes: list[Any], worker_id: str = "") -> None:
        """Send finished episodes (without waiting for the actor)."""
        self.handle.record.remote(episodes, worker_id)

    def history(self, start: int = 0) -> list[Any]:
        """Episodes with ``index >= start``, in the order they were recorded."""
        return ray.get(self.handle.history.remote(start), timeout=self.timeout_s)


class RolloutFleet:
    """Creates ``n_workers`` RolloutWorker actors and keeps them alive (run it as a Ray actor).

    Args:
        config: size, resources and supervision.
        manager_factory: picklable ``worker_id -> RolloutManager`` run inside each worker.
        writer: picklable writer every worker sends its items to.
        curriculum: the lessons of a group run: the fleet starts one curriculum actor from it, shared by all
            its workers; ``None`` for step managers.
    """

    def __init__(
        self,
        config: FleetConfig,
        manager_factory: Callable[[str], RolloutManager],
        writer: ExperienceWriter,
        curriculum: CurriculumConfig | None = None,
    ) -> None:
        self.config = config
        self.manager_factory = manager_factory
        self.writer = writer
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.stats = RemoteStatistics(_RemoteStatistics.options(num_cpus=0, scheduling_strategy=here).remote())
        self.curriculum = (
            None
            if curriculum is None
            else RemoteCurriculum(start_curriculum_actor(curriculum, scheduling_strategy=here), curriculum)
        )
        self.events: list[str] = []
        self.restarts = [0] * config.n_workers
        self.abandoned: set[int] = set()  # slots whose restart limit ran out
        self._lock = threading.RLock()
        self._weights: tuple[int, list[Any]] | None = None
        self._workers = [self._spawn(i) for i in range(config.n_workers)]
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="fleet-supervisor", daemon=True)
        self._supervisor.start()

    def _spawn(self, slot: int) -> Any:
        worker_id = f"w{slot}" if self.restarts[slot] == 0 else f"w{slot}r{self.restarts[slot]}"
        actor = _RemoteWorker.options(
            num_cpus=self.config.worker_num_cpus,
            resources=dict(self.config.worker_resources),
            scheduling_strategy="SPREAD" if self.config.placement == "spread" else "DEFAULT",
            max_restarts=0,  # the fleet restarts a lost worker itself, with the newest weights, on a live node
        ).remote(worker_id, self.manager_factory, self.writer, self.config.worker, self.stats, self.curriculum)
        actor.start.remote()
        if self._weights is not None:
            actor.offer_weights.remote(*self._weights)
        return actor

    def offer_weights(self, version: int, refs: list[Any]) -> int:
        """Forward a weight reference to every worker; returns the number of workers it went to."""
        with self._lock:
            self._weights = (version, refs)
            for actor in self._workers:
                actor.offer_weights.remote(version, refs)
            return len(self._workers)

    def problem(self) -> str | None:
        """Why the fleet cannot produce any more (every slot out of restarts), or ``None`` while it can."""
        with self._lock:
            return slots_problem(len(self._workers), self.abandoned, self.events)

    def statistics(self) -> RemoteStatistics:
        """The episode statistics every worker reports to."""
        return self.stats

    def curriculum_actor(self) -> Any:
        """The shared curriculum actor handle (``None`` without a curriculum)."""
        return None if self.curriculum is None else self.curriculum.handle

    def workers(self) -> list[Any]:
        """The current worker actor handles, by slot."""
        with self._lock:
            return list(self._workers)

    def status(self) -> dict[str, Any]:
        """Every worker's ``info`` (``{"state": "dead"}`` when it does not answer), restarts, events, and the
        fleet's pipeline timings: seconds per stage, environment steps, forward passes and the observations
        they took (``inference_obs``), summed over the live workers."""
        return fleet_status(self._infos(self.workers()), self.restarts, self.events)

    def _infos(self, actors: list[Any]) -> list[dict[str, Any]]:
        infos = []
        for slot, actor in enumerate(actors):
            try:
                infos.append(ray.get(actor.info.remote(), timeout=self.config.info_timeout_s))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                infos.append({"worker_id": f"w{slot}", "state": "dead", "error": type(exc).__name__})
        return infos

    def stop(self) -> list[dict[str, Any]]:
        """Stop the supervisor and every worker (each sender drains first; environment processes exit with their
        worker). Returns each worker's final ``info``, whose ``items_sent`` then counts every item its writer
        acknowledged (``{"state": "dead"}`` for a worker that does not answer)."""
        self._stop.set()
        self._supervisor.join(timeout=10.0)
        actors = self.workers()
        stops = [actor.stop.remote() for actor in actors]
        ray.wait(stops, num_returns=len(stops), timeout=30.0)  # a dead worker does not cut the others' drain short
        infos = self._infos(actors)
        for actor in actors:
            ray.kill(actor)
        return infos

    def _supervise(self) -> None:
        while not self._stop.wait(self.config.supervise_every_s):
            for slot, actor in enumerate(self.workers()):
                if slot in self.abandoned:
                    continue
                reason = self._check(actor)
                if reason is not None and not self._stop.is_set():
                    self._restart(slot, actor, reason)

    def _check(self, actor: Any) -> str | None:
        """``None`` when the worker is healthy, else why it must be replaced."""
        try:
            info = ray.get(actor.info.remote(), timeout=self.config.info_timeout_s)
        except ray.exceptions.RayActorError as exc:
            lines = [line.strip() for line in str(exc).splitlines() if "died because" in line]
            return f"actor died ({type(exc).__name__}{': ' + lines[0] if lines else ''})"
        except ray.exceptions.GetTimeoutError:
            return f"no answer within {self.config.info_timeout_s} s"
        if info["state"] == "failed":
            return f"failed: {info['error'].splitlines()[0] if info['error'] else '?'}"
        return None

    def _restart(self, slot: int, actor: Any, reason: str) -> None:
        with self._lock:
            if self.restarts[slot] >= self.config.max_restarts:
                self.abandoned.add(slot)
                ray.kill(actor, no_restart=True)
                self.events.append(f"worker slot {slot} {reason}; restart limit reached, slot left empty")
                return
            ray.kill(actor, no_restart=True)
            self.restarts[slot] += 1
            self._workers[slot] = self._spawn(slot)
            self.events.append(f"worker slot {slot} {reason}; restarted (restart {self.restarts[slot]})")


_RemoteFleet = ray.remote(RolloutFleet)


class FleetClient:
    """The trainer's handle on a fleet: publish weights, read statistics, stop; never hangs on a dead fleet.

    Args:
        actor: the ``RolloutFleet`` actor handle.
        timeout_s: the longest any call may take before it raises :class:`FleetError`.
    """

    def __init__(self, actor: Any, timeout_s: float = 60.0) -> None:
        self.actor = actor
        self.timeout_s = timeout_s
        self._publisher = RayWeightPublisher(actor, timeout_s=timeout_s)
        self._stats: Any = None

    @classmethod
    def start(
        cls,
        config: FleetConfig,
        manager_factory: Callable[[str], RolloutManager],
        writer: ExperienceWriter,
        timeout_s: float = 60.0,
        curriculum: CurriculumConfig | None = None,
    ) -> FleetClient:
        """Create the fleet actor on the caller's node (0 CPUs; its workers reserve theirs, spread over the
        cluster) and return a client for it (``curriculum``: see :class:`RolloutFleet`)."""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = _RemoteFleet.options(num_cpus=0, max_concurrency=4, scheduling_strategy=here).remote(
            config, manager_factory, writer, curriculum
        )
        return cls(actor, timeout_s)

    def _call(self, ref: Any, what: str) -> Any:
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.RayActorError as exc:
            raise FleetError(f"the rollout fleet is dead ({what} failed: {exc}); restart the run") from exc
        except ray.exceptions.GetTimeoutError as exc:
            raise FleetError(
                f"the rollout fleet did not answer {what} within {self.timeout_s} s; check the Ray logs"
            ) from exc

    def publish(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        """Broadcast ``weights`` as ``version`` (one object-store put, forwarded by reference)."""
        try:
            self._publisher.publish(version, weights)
        except ray.exceptions.RayActorError as exc:
            raise FleetError(f"the rollout fleet is dead (publish {version} failed: {exc})") from exc
        except ray.exceptions.GetTimeoutError as exc:
            raise FleetError(f"the rollout fleet did not accept weights {version} in {self.timeout_s} s") from exc

    def curriculum(self) -> Any:
        """The fleet's shared curriculum actor handle (``None`` without a curriculum)."""
        return self._call(self.actor.curriculum_actor.remote(), "curriculum")

    def status(self) -> dict[str, Any]:
        """Workers, restarts and events (raises :class:`FleetError` when the fleet is gone)."""
        return self._call(self.actor.status.remote(), "status")

    def statistics(self) -> RemoteStatistics:
        """The fleet's episode statistics (cached)."""
        if self._stats is None:
            self._stats = self._call(self.actor.statistics.remote(), "statistics")
        return self._stats

    def check(self) -> None:
        """Raise :class:`FleetError` when the fleet actor is dead, does not answer, or has no workers left."""
        raise_if_cannot_produce(self._call(self.actor.problem.remote(), "a liveness check"))

    def stop(self) -> list[dict[str, Any]]:
        """Stop the workers and the fleet actor; returns the workers' final ``info`` (see
        :meth:`RolloutFleet.stop`), or ``[]`` when the fleet is dead or does not answer. Safe on a dead fleet."""
        infos: list[dict[str, Any]] = []
        try:
            infos = ray.get(self.actor.stop.remote(), timeout=self.timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        ray.kill(self.actor)
        return infos


def start_replay_buffer(
    batch_size: int,
    max_staleness: int,
    max_queued: int | None = None,
    storage: str = "memory",
    *,
    max_restarts: int = 0,
    resources: Mapping[str, float] | None = None,
) -> Any:
    """Start a :class:`~rollhub.rollout.replay.ReplayBuffer` Ray actor (0 CPUs; threads so a waiting ``next_batch``
    never blocks ``add``).

    Args:
        batch_size, max_staleness, max_queued, storage: as for :class:`~rollhub.rollout.replay.ReplayBuffer`.
        max_restarts: how often Ray restarts the actor after its process or node is lost (-1: always). Needs
            ``sqlite:///`` storage at an absolute path that every node it may restart on sees; calls in flight
            when it died are retried on the restarted actor (an ``add`` whose answer was lost may then be stored
            twice; none is lost).
        resources: Ray custom resources the actor requires (e.g. ``{"replay": 1}``): it starts, and restarts, only
            on nodes offering them, i.e. the nodes that see the database file. Without them it runs on the caller's
            node when ``max_restarts`` is 0, else wherever Ray places it (at the start and after each restart).

    Raises:
        ConfigError: ``max_restarts`` with memory storage (a restarted buffer would come back empty).
    """
    if max_restarts != 0 and not storage.startswith("sqlite://"):
        raise ConfigError(
            f"max_restarts={max_restarts} with storage={storage!r}: a restarted buffer would come back empty; "
            "use storage='sqlite:////shared/path/replay.db' on storage every node sees, or max_restarts=0"
        )
    placement: dict[str, Any] = {"resources": dict(resources)} if resources else {}
    if not resources and max_restarts == 0:
        node = ray.get_runtime_context().get_node_id()
        placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    actor_cls = ray.remote(ReplayBuffer)
    return actor_cls.options(
        num_cpus=0,
        max_concurrency=8,
        max_restarts=max_restarts,
        max_task_retries=-1 if max_restarts != 0 else 0,
        **placement,
    ).remote(batch_size, max_staleness, max_queued, storage)
