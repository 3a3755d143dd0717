"""`RolloutWorker`: coordinates one RolloutManager (manager computes, worker coordinates), in any fleet backend.

The worker owns everything around the manager: weights (any :class:`~rollhub.weights.base.WeightSubscriber`,
polled between two ``sample_batch`` calls, i.e. between inference batches, and passed on as
``policy_version`` so everything is tagged with the version actually loaded), the staleness bound
(``min_version``, from :class:`~rollhub.experience.StalenessPolicy` against the newest version offered),
storage (a bounded queue drained by a sender thread, so a slow buffer blocks sampling instead of growing
memory), episode statistics and pipeline timings, the tracker that logs what the manager reports, the
``max_rollouts`` budget, and on the group path the curriculum duties
(:class:`~rollhub.rollout.group.lessons.LessonPlan`: lesson choice, evaluation schedule, statistics reported to the
run's shared curriculum).

The worker runs as a thread (the local fleet), in a process of its own (the process fleet) or as a Ray actor (the
Ray fleet, which runs :class:`~rollhub.rollout.backends.ray.RayRolloutWorker`: weights as object references, the
Ray node in ``info``); it imports no Ray itself.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollhub.client.trackers import Tracker, make_tracker
from rollhub.curriculum.shared import CurriculumLike
from rollhub.errors import ConfigError, QueueFull
from rollhub.experience import StalenessPolicy
from rollhub.rollout.group.lessons import CallKind, LessonPlan
from rollhub.rollout.protocols import (
    BacklogWriter,
    EnvProcessManager,
    EpisodeResult,
    ExperienceWriter,
    NewestVersionSubscriber,
    OfferedSubscriber,
    RolloutManager,
    SampleRequest,
    SampleResult,
    SubscribingManagerFactory,
)
from rollhub.rollout.stats import PipelineMonitor
from rollhub.weights.base import OfferedWeightSubscriber, WeightSubscriber, WeightUpdate

ADMISSION_POLL_S = 0.05  # how often a worker held back by admission control asks for the backlog again


class WorkerState(enum.Enum):
    """Lifecycle of a worker: waiting for its first weights, running, finished (``max_rollouts`` reached; the
    sender still drains), stopped, or failed (see ``error``)."""

    WAITING_FOR_WEIGHTS = "waiting_for_weights"
    RUNNING = "running"
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"


def _behind(trainer_version: int | None, version: int) -> int:
    """How many versions ``version`` is behind ``trainer_version`` (0 when that is unknown or not newer)."""
    return 0 if trainer_version is None else max(0, trainer_version - version)


@dataclass(frozen=True)
class RolloutWorkerConfig:
    """Coordination settings of one worker.

    Attributes:
        max_staleness: what is produced with weights more than this many versions older than the newest
            offered one is dropped before it forms an item (``None``: no bound); see ``StalenessPolicy``.
        queue_size: items waiting for the sender thread; when full, sampling blocks (backpressure).
        write_interval_s: the shortest time between two writes of the sender. Items made sooner after a write
            wait, up to this long, and leave together in the next one: a worker making hundreds of fragments a
            second pays the writer's per-call cost (a pipe round trip, a Ray call) a few dozen times a second,
            not hundreds. A write after a quiet spell goes at once, and nothing waits while the queue is at
            least half full, while the loop waits for new weights (pacing), or once the worker stops; so slow
            environments and paced runs lose no time to it. 0: every write as soon as items are queued.
        stats_every_s: how often finished episodes are sent to the fleet's statistics.
        max_rollouts: stop sampling after this many training ``sample_batch`` calls that produced items
            (None: no limit).
        tracker: where ``SampleResult.metrics`` are logged: ``"none"``, ``"wandb"`` or ``"jsonl:PATH"``, where
            ``{worker_id}`` in PATH is replaced by the worker's id (a spec string, so the config pickles).
        drain_s: on ``stop()``, how long the sender may keep writing what is still queued.
        seed: the run's seed; with the worker id it seeds the worker's lesson draws (group path).
        items_per_version: pace the worker to the trainer: after this many training items made with one weight
            version it waits for the next version (``None``: no pacing). Set to the trainer's batch divided
            among the workers, the fleet makes one batch per version while the trainer learns from the
            previous one, instead of running ahead into data that will be stale before it is used.
        pace_timeout_s: the longest a paced worker waits for a new version before it makes another round
            anyway (so a batch short of a dropped item never stalls the trainer and the fleet on each other).
        admission_batch: admission control (group path; needs ``max_staleness`` and a writer that is a
            :class:`~rollhub.rollout.protocols.BacklogWriter`, e.g. the buffer server's), given the trainer's
            batch in groups ``B``. The trainer takes ``B`` groups per version, oldest first, so a group queued
            behind ``Q`` others is trained on ``Q // B`` versions after the version the next batch is trained
            at (the server's ``next_batch_version``: the published one, plus one while the trainer learns from
            a batch it was served since publishing). A training turn makes only the groups that fit: counted
            ``backlog_share`` times (the worker cannot see the other workers' turns), with the groups queued at the
            server and ``backlog_share`` times this worker's own not yet written, in ``(max_staleness - lag) * B``,
            ``lag`` being how many versions the worker's weights are behind the trainer's latest published ones.
            Everything admitted is served within the bound (exactly at it while the trainer learns from a batch, a
            batch within it while the trainer waits for one). A turn that would make more is capped
            (``SampleRequest.max_examples``; ``capped_turns`` in its info), and a worker waits only while not one
            group fits. A worker is also admitted while less than one batch is queued and nothing is unwritten
            here (starving): the trainer cannot take a batch without more groups, so the loop never waits on
            itself (a prompt left out for an aborted completion leaves the queue a few groups short of a batch).
            Its groups then fit while ``queued + backlog_share * turn <= (max_staleness - lag_next + 1) * B``,
            ``lag_next`` being how far its weights are behind the version the next batch is trained at, and its
            turn is capped there; past that the last of its groups would be served too stale and dropped, so when
            not one fits (its weights more than ``max_staleness`` behind that version) it waits for the newer
            weights the trainer has published or is about to (at most ``stale_weights_wait_s``, then it samples
            a whole turn; ``weights_waits`` in its info counts these waits). Before turns were capped, a fleet
            whose ``backlog_share`` times a whole turn exceeded that budget (two workers at ``max_staleness = 0``,
            four at 2 with a turn of one batch) waited ``stale_weights_wait_s`` for every batch (``None``: no
            admission control).
        stale_weights_wait_s: the longest a worker held back for weights more than ``max_staleness`` versions
            behind the trainer's waits for newer ones before it samples anyway (and logs an event); the
            server's staleness guard then drops what is too old.
        backlog_share: how many workers share the budget (each counts its own groups this many times, as it
            cannot see the others').
    """

    max_staleness: int | None = 2
    queue_size: int = 32
    write_interval_s: float = 0.02
    stats_every_s: float = 0.5
    max_rollouts: int | None = None
    tracker: str = "none"
    drain_s: float = 5.0
    seed: int = 0
    items_per_version: int | None = None
    pace_timeout_s: float = 1.0
    admission_batch: int | None = None
    backlog_share: int = 1
    stale_weights_wait_s: float = 120.0

    def __post_init__(self) -> None:
        if self.admission_batch is not None and self.admission_batch < 1:
            raise ConfigError(f"admission_batch must be >= 1 group or None, got {self.admission_batch}")
        if self.admission_batch is not None and self.max_staleness is None:
            raise ConfigError("admission_batch needs a max_staleness bound to fit the backlog in")
        if self.backlog_share < 1:
            raise ConfigError(f"backlog_share must be >= 1 worker, got {self.backlog_share}")
        if self.items_per_version is not None and self.items_per_version < 1:
            raise ConfigError(f"items_per_version must be >= 1 or None, got {self.items_per_version}")
        if not self.write_interval_s >= 0:
            raise ConfigError(f"write_interval_s must be >= 0 seconds, got {self.write_interval_s}")
        if not self.stale_weights_wait_s > 0:
            raise ConfigError(f"stale_weights_wait_s must be > 0 seconds, got {self.stale_weights_wait_s}")
        if not self.pace_timeout_s > 0:
            raise ConfigError(f"pace_timeout_s must be > 0 seconds, got {self.pace_timeout_s}")


@dataclass
class _Pace:
    """A paced worker's count: training items made with ``version``, and since when it waits for the next."""

    version: int = -1
    items: int = 0
    waiting_since: float | None = None


class RolloutWorker:
    """Runs ``manager.sample_batch`` in a loop thread and ships the items through a sender thread.

    Created by every fleet backend (:mod:`rollhub.rollout.backends`); usable as a plain object too.

    Args:
        worker_id: the id written into every item.
        manager_factory: builds the manager inside this process, called with ``worker_id``.
        writer: where items go (e.g. :class:`rollhub.rollout.backends.ray.ActorWriter` of the replay buffer).
        config: staleness and queue settings.
        statistics: where finished episodes go: anything with ``record(episodes, worker_id)`` (the Ray fleet's
            :class:`~rollhub.rollout.backends.ray.RemoteStatistics`, the local fleet's
            :class:`~rollhub.rollout.stats.SharedStatistics`), or ``None`` to keep them in ``episodes``.
        curriculum: the run's shared curriculum (group managers: each turn samples one of its lessons, and
            every call's statistics are reported to it); ``None`` for step managers.
        subscriber: where weights come from; ``None``: the manager factory's ``subscriber(worker_id)`` when it
            is a :class:`~rollhub.rollout.protocols.SubscribingManagerFactory` (an inference engine the trainer
            pushes weights into: the worker only reads its version), else the worker's own subscriber fed by
            :meth:`offer_weights` (what a fleet uses; see :meth:`_offered_weights`).
    """

    def __init__(
        self,
        worker_id: str,
        manager_factory: Callable[[str], RolloutManager],
        writer: ExperienceWriter,
        config: RolloutWorkerConfig | None = None,
        statistics: Any = None,
        curriculum: CurriculumLike | None = None,
        subscriber: WeightSubscriber | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.config = config or RolloutWorkerConfig()
        self.writer = writer
        self.statistics = statistics
        if subscriber is None and isinstance(manager_factory, SubscribingManagerFactory):
            subscriber = manager_factory.subscriber(worker_id)
        self.subscriber: WeightSubscriber = self._offered_weights() if subscriber is None else subscriber
        # The newest version there is, when the subscriber knows it (the staleness bound is measured from it).
        self._newest = subscriber if isinstance(subscriber, NewestVersionSubscriber) else None
        self.staleness = StalenessPolicy(self.config.max_staleness)
        self.lessons = None if curriculum is None else LessonPlan(curriculum, worker_id, self.config.seed)
        self.monitor = PipelineMonitor()
        self.state = WorkerState.WAITING_FOR_WEIGHTS
        self.error = ""
        self.events: list[str] = []
        self.items_sent = 0
        self.items_unsent = 0  # still queued when stop() gave up draining: reported, never silently lost
        self.dropped_steps = 0
        self.dropped_groups = 0
        self.aborted_groups = 0  # training groups left out whole for an aborted completion (push, dead engine)
        self.rollouts = 0  # training sample_batch calls that produced items (what max_rollouts counts)
        self.turns = 0
        self.episodes: list[EpisodeResult] = []
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=self.config.queue_size)
        self._stop = threading.Event()
        self._drain_until = float("inf")  # the sender stops at _stop once the queue is empty or this passes
        self._loop_done = threading.Event()
        self._flush = threading.Event()  # the sender's wait before a write ends now (see write_interval_s)
        self._last_write = -float("inf")
        self.writes = 0
        self._threads: list[threading.Thread] = []
        self._pace = _Pace()
        self._request: SampleRequest | None = None  # the step path's request of the last turn
        self.pace_waits = 0  # turns skipped waiting for a new version
        self.admission_waits = 0  # turns held back by admission control (see max_backlog)
        self.admission_wait_s = 0.0  # seconds spent held back
        self._turn_cap: int | None = None  # admission control's cap on the next turn's groups (None: no cap)
        self.capped_turns = 0  # training turns admission control capped below the largest turn made so far
        self._largest_turn = 0
        self._made_items = 0  # handed to the sender; minus items_sent and items_unsent: what it still holds
        self._held_since: float | None = None
        self._behind_since: float | None = None  # since when a starving worker waits for newer weights
        self.weights_waits = 0  # times a starving worker waited for newer weights (see admission_batch)
        self._backlog = writer.backlog if isinstance(writer, BacklogWriter) else None
        if self.config.admission_batch is not None and self._backlog is None:
            raise ConfigError(
                f"admission_batch needs a writer that reports its backlog; {type(writer).__name__} does not",
                field="admission_batch",
            )
        self.tracker = self._make_tracker()
        self.manager = manager_factory(worker_id)

    def _offered_weights(self) -> OfferedWeightSubscriber:
        """The subscriber :meth:`offer_weights` feeds when none is given: offered :class:`WeightUpdate` values
        (the Ray fleet's worker takes object references instead)."""
        return OfferedWeightSubscriber()

    def _node_id(self) -> str | None:
        """The Ray node this worker runs on (``None`` outside Ray; the Ray fleet's worker names it)."""
        return None

    def _make_tracker(self) -> Tracker:
        tracker = make_tracker(self.config.tracker.replace("{worker_id}", self.worker_id))
        tracker.init(project=None, group=None, name=self.worker_id, config={"worker_id": self.worker_id})
        return tracker

    # ---- remote API -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the sampling loop and the sender thread (idempotent)."""
        if self._threads:
            return
        for target, name in ((self._loop, "rollout-loop"), (self._send_loop, "rollout-sender")):
            thread = threading.Thread(target=target, name=f"{name}-{self.worker_id}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def offer_weights(self, version: int, payload: list[Any] | WeightUpdate) -> None:
        """Offer a new weight version (a one-element list holding an object reference, or the value).

        Raises:
            ConfigError: the worker's subscriber takes no offers (it fetches weights itself).
        """
        if not isinstance(self.subscriber, OfferedSubscriber):
            raise ConfigError(
                f"the worker's subscriber ({type(self.subscriber).__name__}) takes no offered weights; "
                "publish through its own transport",
                field="subscriber",
            )
        self.subscriber.offer(version, payload)

    def loaded_version(self) -> int | None:
        """The weight version the manager runs with now (``None`` before the first)."""
        return self.subscriber.loaded_version

    def info(self) -> dict[str, Any]:
        """A snapshot: state, loaded version, counters, pipeline timings, recent events, pids, and the Ray node
        it runs on (``node_id``, ``None`` outside Ray)."""
        envs = self.manager if isinstance(self.manager, EnvProcessManager) else None
        return {
            "worker_id": self.worker_id,
            "state": self.state.value,
            "error": self.error,
            "loaded_version": self.subscriber.loaded_version,
            "items_sent": self.items_sent,
            "items_unsent": self.items_unsent,
            "writes": self.writes,
            "rollouts": self.rollouts,
            "queued": self._queue.qsize(),
            "dropped_steps": self.dropped_steps,
            "dropped_groups": self.dropped_groups,
            "aborted_groups": self.aborted_groups,
            "turns": self.turns,
            "pace_waits": self.pace_waits,
            "admission_waits": self.admission_waits,
            "capped_turns": self.capped_turns,
            "admission_wait_s": round(self.admission_wait_s + self._held_for(), 3),
            "weights_waits": self.weights_waits,
            "pipeline": self.monitor.snapshot(),
            "events": list(self.events[-20:]),
            "pid": os.getpid(),
            "env_pids": [] if envs is None else envs.env_pids(),
            "env_restarts": 0 if envs is None else envs.env_restarts(),
            "node_id": self._node_id(),
        }

    def stop(self) -> None:
        """Stop sampling, let the sender write what is queued (up to ``drain_s``), shut the manager down,
        close the writer and finish the tracker; idempotent. Items left unwritten count in ``items_unsent``."""
        self._drain_until = time.monotonic() + self.config.drain_s
        self._stop.set()
        self._flush.set()
        for thread in self._threads:
            thread.join(timeout=10.0 + self.config.drain_s)
        self.items_unsent += self._queue.qsize()
        while not self._queue.empty():
            self._queue.get_nowait()
        self.manager.shutdown()
        self.writer.close()
        self.tracker.finish()
        if self.state is not WorkerState.FAILED:
            self.state = WorkerState.STOPPED

    # ---- threads ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        last_flush = time.monotonic()
        try:
            while not self._stop.is_set():
                version = self._sync_weights()
                if version is None:
                    time.sleep(0.01)
                    continue
                self.state = WorkerState.RUNNING
                if self._paced(version) or self._held_back(version):
                    continue
                self._turn(version)
                if self.config.max_rollouts is not None and self.rollouts >= self.config.max_rollouts:
                    self.events.append(f"reached max_rollouts={self.config.max_rollouts}")
                    self.state = WorkerState.FINISHED
                    break
                if time.monotonic() - last_flush >= self.config.stats_every_s:
                    self._flush_episodes()
                    last_flush = time.monotonic()
            self._flush_episodes()
        except Exception as exc:  # the fleet sees FAILED and restarts this worker
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
            self.state = WorkerState.FAILED
        finally:
            self._loop_done.set()
            self._flush.set()

    def _sync_weights(self) -> int | None:
        """Load the newest weights into the manager if there are new ones; the version now loaded."""
        update = self.subscriber.poll()
        if update is not None:
            self.manager.update_model(update.weights)
        return self.subscriber.loaded_version

    def _paced(self, version: int) -> bool:
        """Whether this turn waits for a newer version (see ``RolloutWorkerConfig.items_per_version``)."""
        quota, pace = self.config.items_per_version, self._pace
        if quota is None:
            return False
        if version != pace.version:
            self._pace = _Pace(version)
            return False
        if pace.items < quota:
            return False
        now = time.monotonic()
        if pace.waiting_since is None:
            pace.waiting_since = now
            self._flush.set()  # the trainer needs what is queued before it publishes the version we wait for
        elif now - pace.waiting_since > self.config.pace_timeout_s:
            self._pace = _Pace(version)  # the trainer did not move on: make another round
            return False
        self.pace_waits += 1
        time.sleep(0.0005)
        return True

    def _held_back(self, version: int) -> bool:
        """Whether admission control holds the next turn back (see ``RolloutWorkerConfig.admission_batch``); an
        admitted turn is capped at what fits (``self._turn_cap``, ``None``: no cap)."""
        batch, bound = self.config.admission_batch, self.config.max_staleness
        self._turn_cap = None
        if batch is None or bound is None or self._backlog is None:
            return False
        # what this worker holds (queued here or in a write under way) is read before the server's queue: a write
        # landing in between is then counted twice, never missed (read after, it would be in neither count)
        unsent = self._made_items - self.items_sent - self.items_unsent
        backlog = self._backlog()
        share = self.config.backlog_share
        lag = _behind(backlog.policy_version, version)  # versions behind the trainer's published weights
        lag_next = _behind(backlog.upcoming_version, version)  # ... behind those the next batch is trained at
        # the groups a turn may make: with those queued at the server, this worker's unsent ones counted for every
        # worker (the others' are unseen), and every other worker taken to have a whole turn (the largest this one
        # made) under way, they fit in the budget; a whole turn when there is room for one, fewer when less
        others = (share - 1) * self._largest_turn
        fit: int | None = (bound - lag) * batch - backlog.queued - share * unsent - others
        if backlog.queued < batch and unsent == 0:  # starving: the trainer cannot take a batch without more groups
            # a starving turn's groups are served a batch per version from the next batch on: all within the
            # bound while they fit in (bound - lag_next + 1) * batch. Past that the last of them would be dropped;
            # when not one fits (the weights are more than the bound behind the next batch's version), wait for
            # the weights the trainer has published (or publishes once it has learnt from the batch it holds)
            slots = (bound - lag_next + 1) * batch - backlog.queued if lag_next <= bound else 0
            if slots >= 1:
                # at least one group: starving workers that each take the others to hold a whole turn would
                # otherwise all wait on a batch the others' turns do not fill (at worst a group per worker is
                # served a version late, and past the bound dropped, instead of every worker waiting)
                fit = max(fit, 1, slots - others)  # type: ignore[type-var]
                self._behind_since = None
            elif self._waited_for_weights(lag_next):
                fit = None  # waited long enough: sample a whole turn anyway (the server's guard drops the stale)
        else:
            self._behind_since = None
        if fit is None or fit >= 1:
            self._turn_cap = fit
            self.admission_wait_s += self._held_for()
            self._held_since = None
            return False
        if self._held_since is None:
            self._held_since = time.monotonic()
            self.admission_waits += 1
            self._flush.set()  # what is queued here counts against the budget until it is sent
        self._stop.wait(ADMISSION_POLL_S)
        return True

    def _waited_for_weights(self, lag: int) -> bool:
        """Whether a starving worker ``lag`` versions behind has waited ``stale_weights_wait_s`` for newer
        weights (then it samples anyway, and says so in its events)."""
        now, limit = time.monotonic(), self.config.stale_weights_wait_s
        if self._behind_since is None:
            self._behind_since = now
            self.weights_waits += 1
        if now - self._behind_since <= limit:
            return False
        self.events.append(f"sampled with weights {lag} versions behind the trainer's after {limit:g} s waiting")
        self._behind_since = None
        return True

    def _held_for(self) -> float:
        """Seconds the current hold has lasted (0 when not held)."""
        return 0.0 if self._held_since is None else time.monotonic() - self._held_since

    def _min_version(self, loaded: int) -> int | None:
        """The oldest version still fresh against the newest one offered (the staleness policy's floor)."""
        offered = None if self._newest is None else self._newest.offered_version
        return self.staleness.oldest_fresh(loaded if offered is None else max(offered, loaded))

    def _turn(self, version: int) -> None:
        """One turn: the planned calls (on the group path evaluations first, then training), the training
        items queued for the sender, statistics reported to the curriculum, metrics logged."""
        min_version = self._min_version(version)
        calls: list[tuple[CallKind, SampleRequest]] = (
            [("train", self._train_request(version, min_version))]
            if self.lessons is None
            else self.lessons.plan(self.turns, version, self.worker_id, min_version)
        )
        metrics: dict[str, float] = {}
        for kind, request in calls:
            if kind == "train" and self._turn_cap is not None:
                request = dataclasses.replace(request, max_examples=self._turn_cap)
            result = self.manager.sample_batch(request)
            self._account(result)
            if self.lessons is not None:
                metrics.update(self.lessons.report(kind, request, result, self.turns))
            else:
                metrics.update(result.metrics)
            if kind == "train":
                self.aborted_groups += int(result.metrics.get("aborted_groups", 0))
                self.capped_turns += self._turn_cap is not None and self._turn_cap < self._largest_turn
                self._largest_turn = max(self._largest_turn, len(result.items))
                for item in result.items:
                    self._put(item)
                self.rollouts += bool(result.items)
                if self._pace.version == version:
                    self._pace.items += len(result.items)
        if metrics:
            turn = {"turn": float(self.turns)} if self.lessons is not None else {}
            self.tracker.log({"worker_rollouts": self.rollouts, "policy_version": version, **turn, **metrics})
        self.turns += 1

    def _train_request(self, version: int, min_version: int | None) -> SampleRequest:
        """The step path's request: the same (frozen) object while the versions stay the same."""
        request = self._request
        if request is None or request.policy_version != version or request.min_version != min_version:
            request = self._request = SampleRequest(version, self.worker_id, min_version)
        return request

    def _account(self, result: SampleResult) -> None:
        self.monitor.add(result.timings, result.env_steps, result.inference_batch, result.forward_passes)
        self.dropped_steps += result.dropped_steps
        self.dropped_groups += result.dropped_groups
        self.events.extend(result.events)
        self.episodes.extend(result.episodes)

    def _put(self, item: Any) -> None:
        self._made_items += 1
        while self._may_send():
            try:
                self._queue.put(item, timeout=0.1)
                if 2 * self._queue.qsize() >= self.config.queue_size:
                    self._flush.set()
                return
            except queue.Full:
                continue
        self.items_unsent += 1

    def _may_send(self) -> bool:
        """Before ``stop()``: always; after it: until ``drain_s`` has passed."""
        return not self._stop.is_set() or time.monotonic() < self._drain_until

    def _draining(self) -> bool:
        """The sender goes on until stopped, then while the loop may still queue or the queue holds items."""
        pending = not self._loop_done.is_set() or not self._queue.empty()
        return not self._stop.is_set() or (pending and self._may_send())

    def _send_loop(self) -> None:
        while self._draining():
            try:
                items = [self._queue.get(timeout=0.1)]
            except queue.Empty:
                continue
            self._linger()
            while len(items) < 64:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._write(items)

    def _linger(self) -> None:
        """Hold a write due within ``write_interval_s`` of the previous one until then (items made meanwhile go
        with it), unless told to flush."""
        wait = self._last_write + self.config.write_interval_s - time.monotonic()
        if wait > 0 and not self._loop_done.is_set():
            self._flush.wait(wait)
        self._flush.clear()

    def _write(self, items: list[Any]) -> None:
        """Write with retries: ``QueueFull`` waits as told (resending only what was refused); other errors
        fail the worker."""
        while items and self._may_send():
            try:
                self.writer.write(items)
                self.items_sent += len(items)
                self.writes += 1
                self._last_write = time.monotonic()
                return
            except QueueFull as exc:
                accepted = exc.accepted  # a partial write took the first ones
                self.items_sent += accepted
                items = items[accepted:]
                time.sleep(min(max(exc.retry_after_s, 0.01), 1.0))
            except Exception as exc:
                self.error = f"writer failed: {type(exc).__name__}: {exc}"
                self.state = WorkerState.FAILED
                self.items_unsent += len(items)
                self._drain_until = 0.0
                self._stop.set()
                return
        self.items_unsent += len(items)

    def _flush_episodes(self) -> None:
        if self.statistics is None:
            del self.episodes[:-1000]  # kept locally for inspection, bounded
            return
        if not self.episodes:
            return
        episodes, self.episodes = self.episodes, []
        self.statistics.record(episodes, self.worker_id)
