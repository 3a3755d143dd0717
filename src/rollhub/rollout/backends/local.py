"""`LocalFleet`: the rollout fleet without Ray, for one machine: worker threads in the trainer's process.

The same RolloutWorkers as the Ray fleet (versions tagged as loaded, staleness bound, pacing, statistics, a
sender thread per worker) run as threads of the calling process, write into a :class:`ReplayBuffer` held in
that process (:class:`LocalWriter`), and get each weight version as one shared, read-only copy. Supervision is
the Ray fleet's: a worker that fails is replaced, with the newest weights, until its slot's ``max_restarts``
run out. Environments still run in their own processes when the manager says so (``env_processes`` > 0), so a
slow environment keeps the cores busy while the worker thread waits on its pipes.

What it saves against the Ray fleet is the start: no Ray runtime, no actor processes importing torch, no
object store. What it costs is the GIL: a worker stepping microsecond environments in its own thread
(``env_processes = 0``) shares one core with the trainer's Python, so it suits small runs, tests and
environments that run in processes; more cores than one process can use want the process fleet
(:class:`rollhub.rollout.backends.processes.ProcessFleet`, ``[fleet] backend = "processes"``), more than one machine
the Ray fleet (``"ray"``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rollhub.errors import ConfigError
from rollhub.rollout.backends.base import FleetConfig, raise_if_cannot_produce, slots_problem
from rollhub.rollout.protocols import RolloutManager
from rollhub.rollout.replay import ReplayBuffer
from rollhub.rollout.stats import SharedStatistics, fleet_status
from rollhub.rollout.worker import RolloutWorker, WorkerState
from rollhub.weights.base import WeightUpdate, check_newer


class LocalWriter:
    """Writes items straight into a :class:`ReplayBuffer` of this process (its ``QueueFull`` reaches the
    worker's sender, which retries as it does against the Ray actor)."""

    def __init__(self, replay: ReplayBuffer) -> None:
        self.replay = replay

    def write(self, items: list[Any]) -> None:
        """Queue ``items`` in the buffer (raises what ``ReplayBuffer.add`` raises)."""
        self.replay.add(items)

    def close(self) -> None:
        """Nothing is buffered here."""


def _frozen(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One C-ordered, read-only copy of every array, shared by all workers (no worker can change another's)."""
    out = {}
    for name, value in weights.items():
        array = np.array(value, order="C", copy=True)
        array.flags.writeable = False
        out[name] = array
    return out


class LocalFleet:
    """``n_workers`` RolloutWorker threads in this process, started at once and supervised; the surface of
    :class:`FleetClient` (the trainer reads its batches with :class:`rollhub.run.sources.LocalReplaySource`).

    Args:
        config: size and supervision (``n_workers``, ``worker``, ``supervise_every_s``, ``max_restarts``; the Ray
            placement fields do not apply).
        manager_factory: ``worker_id -> RolloutManager``, called in a worker's constructor.
        writer: where every worker writes its items (normally a :class:`LocalWriter`).
        curriculum: must be ``None``: group runs with a curriculum use the Ray fleet.

    Raises:
        ConfigError: a curriculum was given.
        Exception: what ``manager_factory`` raised for a first worker (the workers already built are stopped).
    """

    def __init__(
        self,
        config: FleetConfig,
        manager_factory: Callable[[str], RolloutManager],
        writer: Any,
        curriculum: Any = None,
    ) -> None:
        if curriculum is not None:
            raise ConfigError("the local fleet runs step managers only; use the Ray fleet for a curriculum")
        self.config = config
        self.manager_factory = manager_factory
        self.writer = writer
        self.stats = SharedStatistics()
        self.events: list[str] = []
        self.restarts = [0] * config.n_workers
        self.abandoned: set[int] = set()
        self._lock = threading.RLock()
        self._weights: WeightUpdate | None = None
        self._workers: list[Any] = []
        self._retired: set[int] = set()  # ids of workers already stopped
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="local-fleet-supervisor", daemon=True)
        try:
            for slot in range(config.n_workers):
                self._workers.append(self._spawn(slot))
        except BaseException:
            self.stop()
            raise
        self._supervisor.start()

    def _spawn(self, slot: int) -> Any:
        worker_id = f"w{slot}" if self.restarts[slot] == 0 else f"w{slot}r{self.restarts[slot]}"
        worker = self._new_worker(worker_id)
        if self._weights is not None:
            worker.offer_weights(self._weights.version, self._weights)
        worker.start()
        return worker

    def _new_worker(self, worker_id: str) -> Any:
        """A worker thread (:class:`rollhub.rollout.backends.processes.ProcessFleet` makes worker processes)."""
        return RolloutWorker(worker_id, self.manager_factory, self.writer, self.config.worker, self.stats)

    # ---- the trainer's side -----------------------------------------------------------------------
    def publish(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        """Offer ``weights`` as ``version`` to every worker (one read-only copy, shared).

        Raises:
            InvalidInput: ``version`` is not newer than the last published one.
        """
        with self._lock:
            check_newer(version, None if self._weights is None else self._weights.version)
            self._weights = WeightUpdate(version, _frozen(weights))
            for worker in self._workers:
                worker.offer_weights(version, self._weights)

    def statistics(self) -> SharedStatistics:
        """The episode statistics every worker reports to."""
        return self.stats

    def curriculum(self) -> None:
        """No curriculum: the local fleet runs step managers."""
        return None

    def workers(self) -> list[Any]:
        """The current workers, by slot."""
        with self._lock:
            return list(self._workers)

    def status(self) -> dict[str, Any]:
        """Every worker's ``info``, restarts, events and summed pipeline timings (as ``FleetClient.status``)."""
        with self._lock:
            return fleet_status([w.info() for w in self._workers], self.restarts, self.events)

    def check(self) -> None:
        """Raise :class:`~rollhub.rollout.backends.base.FleetError` when every worker slot has run out of restarts."""
        with self._lock:
            problem = slots_problem(len(self._workers), self.abandoned, self.events)
        raise_if_cannot_produce(problem)

    def stop(self) -> list[dict[str, Any]]:
        """Stop the supervisor and every worker (each sender drains first); return their final ``info``.
        Idempotent."""
        self._stop.set()
        if self._supervisor.is_alive():
            self._supervisor.join(timeout=10.0)
        workers = self.workers()
        for worker in workers:
            self._retire(worker)
        return [w.info() for w in workers]

    # ---- supervision ------------------------------------------------------------------------------
    def _supervise(self) -> None:
        while not self._stop.wait(self.config.supervise_every_s):
            for slot, worker in enumerate(self.workers()):
                if slot not in self.abandoned and worker.state is WorkerState.FAILED and not self._stop.is_set():
                    self._restart(slot, worker)

    def _restart(self, slot: int, worker: Any) -> None:
        reason = f"failed: {worker.error.splitlines()[0] if worker.error else '?'}"
        self._retire(worker)
        with self._lock:
            if self.restarts[slot] >= self.config.max_restarts:
                self.abandoned.add(slot)
                self.events.append(f"worker slot {slot} {reason}; restart limit reached, slot left empty")
                return
            self.restarts[slot] += 1
            try:
                self._workers[slot] = self._spawn(slot)
            except Exception as exc:  # the slot keeps its failed worker: the next round tries again
                self.events.append(f"worker slot {slot} {reason}; its replacement failed to start ({exc})")
                return
            self.events.append(f"worker slot {slot} {reason}; restarted (restart {self.restarts[slot]})")

    def _retire(self, worker: Any) -> None:
        """Stop ``worker`` once (its threads, manager, environment processes and writer)."""
        if id(worker) not in self._retired:
            self._retired.add(id(worker))
            worker.stop()
