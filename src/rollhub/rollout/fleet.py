"""`RolloutFleet`: the Ray actor that creates, feeds and supervises RolloutWorker actors.

The fleet owns the ``EpisodeStatistics`` actor and, on the group path, the run's one curriculum actor that every
worker (replacements included) samples lessons from and reports to; it forwards every weight version to all workers
as one object reference (one ``ray.put`` by the trainer, one ``ray.get`` per worker), and restarts a worker that
died or failed, handing the replacement the newest weights. Workers are spread over the cluster's nodes (Ray's
``SPREAD`` strategy, optionally restricted to nodes offering ``FleetConfig.worker_resources``); a worker whose node
is lost is replaced on a node that is still alive. The fleet and its statistics actor stay on the node of the
process that started the fleet (the trainer's), so losing any other node costs only the workers on it. The trainer
talks to it through :class:`FleetClient`, which turns a dead or unresponsive fleet into a :class:`FleetError`
instead of a hang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollhub.curriculum.actor import RemoteCurriculum, start_curriculum_actor
from rollhub.curriculum.config import CurriculumConfig
from rollhub.errors import ConfigError, RollhubError
from rollhub.rollout.protocols import ExperienceWriter, RolloutManager
from rollhub.rollout.stats import EpisodeStatistics, fleet_status
from rollhub.rollout.worker import RolloutWorker, RolloutWorkerConfig
from rollhub.weights.ray_transport import RayWeightPublisher


class FleetError(RollhubError):
    """The fleet actor is dead or does not answer; the message says what the trainer should do."""


@dataclass(frozen=True)
class FleetConfig:
    """Size, resources and supervision of a fleet.

    Attributes:
        n_workers: RolloutWorker actors.
        worker_num_cpus: Ray CPUs reserved per worker (its environment processes run inside this share).
        worker: the coordination settings every worker gets.
        supervise_every_s: period of the liveness check.
        info_timeout_s: a worker that does not answer ``info`` within this time counts as dead.
        max_restarts: restarts per worker slot before the fleet gives up on that slot.
        placement: ``"spread"`` places workers on as many nodes as possible (Ray's ``SPREAD``); ``"default"``
            uses Ray's default, which fills the local node first.
        worker_resources: Ray custom resources each worker requires (e.g. ``{"rollout": 1}``), so workers only
            go to nodes started with them (``ray start --resources '{"rollout": 4}'``).
    """

    n_workers: int = 2
    worker_num_cpus: float = 0.5
    worker: RolloutWorkerConfig = field(default_factory=RolloutWorkerConfig)
    supervise_every_s: float = 0.5
    info_timeout_s: float = 30.0
    max_restarts: int = 10
    placement: Literal["spread", "default"] = "spread"
    worker_resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_workers < 1:
            raise ConfigError(f"FleetConfig.n_workers is {self.n_workers}; a fleet needs at least 1 worker")
        if self.placement not in ("spread", "default"):
            raise ConfigError(f"FleetConfig.placement is {self.placement!r}; use 'spread' or 'default'")
        bad = {k: v for k, v in self.worker_resources.items() if not (isinstance(v, int | float) and v > 0)}
        if bad:
            raise ConfigError(f"FleetConfig.worker_resources has non-positive amounts {bad}; give each a number > 0")


def slots_problem(n_slots: int, abandoned: set[int], events: list[str]) -> str | None:
    """Why a fleet of ``n_slots`` worker slots cannot produce any more (every slot ``abandoned``: out of
    restarts), naming its last event; ``None`` while it can."""
    if len(abandoned) < n_slots:
        return None
    last = events[-1] if events else "no event recorded"
    return f"all {n_slots} worker slots exhausted their restarts (last: {last})"


def raise_if_cannot_produce(problem: str | None) -> None:
    """Raise :class:`FleetError` for a fleet's ``problem`` (see :func:`slots_problem`); nothing for ``None``."""
    if problem is not None:
        raise FleetError(f"the rollout fleet cannot produce: {problem}; fix the cause and restart the run")


_RemoteWorker = ray.remote(RolloutWorker)
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
