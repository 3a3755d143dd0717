"""The narrow contracts between the rollout roles: manager computes, worker coordinates.

A :class:`RolloutWorker` drives any object implementing :class:`RolloutManager`; the step manager (EnvWorker
processes, fragments) and the group/LLM manager (lessons, groups) plug into the same worker and fleet. Every fleet
(Ray, threads, processes) offers the run that drives it the same :class:`Fleet` surface. Manager
methods are stateless with respect to coordination: the loaded policy version, the worker id, the lesson and
the mode come in a :class:`SampleRequest`, and every result goes back to the worker to store, log and report
to the curriculum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from rollhub.envs.group.scored import GroupStats
from rollhub.experience import Group, SampleFragment
from rollhub.inference.base import PolicyStep
from rollhub.weights.base import WeightSubscriber

SampleMode = Literal["train", "eval"]


@dataclass(frozen=True)
class SampleRequest:
    """What the worker asks of one ``sample_batch`` call.

    Attributes:
        policy_version: the version of the weights loaded in the manager; everything produced is tagged with it.
        worker_id: the id of the calling worker, copied into the items.
        min_version: the oldest policy version the worker still accepts (``None``: any); the manager produces
            nothing older: partly built items with older steps are dropped, and a group manager whose loaded
            version is older samples nothing.
        lesson_id: the lesson to sample (group managers; step managers ignore it).
        mode: ``"train"`` samples training groups; ``"eval"`` one greedy completion per held-out prompt.
        n_examples: prompts to sample (group managers; ``None``: the lesson's ``n_examples``).
        seed: seed of the call's random stream (group managers), so a request reproduces its prompts.
        max_examples: at most this many prompts (group managers; ``None``: no cap): admission control's cap on a
            turn, so a worker makes what still fits the staleness budget instead of waiting for room for a whole
            turn.
    """

    policy_version: int
    worker_id: str
    min_version: int | None = None
    lesson_id: str | None = None
    mode: SampleMode = "train"
    n_examples: int | None = None
    seed: int = 0
    max_examples: int | None = None


@dataclass(frozen=True)
class EpisodeResult:
    """One finished (or cut) episode, for the episode statistics.

    Attributes:
        task: the environment's statistics label.
        ret: undiscounted return.
        discounted_return: return discounted by the manager's ``gamma``.
        length: number of steps.
        terminated: the episode reached a terminal state (``False`` means it was truncated or cut).
        version: the policy version of its last step.
    """

    task: str
    ret: float
    discounted_return: float
    length: int
    terminated: bool
    version: int


@dataclass
class SampleResult:
    """What one ``sample_batch`` call produced.

    Attributes:
        items: finished experience for the worker to store, oldest first: ``Group``s from a group manager,
            ``SampleFragment``s from a step manager.
        episodes: episodes that ended during the call.
        env_steps: environment steps taken during the call.
        dropped_steps: steps thrown away because they became older than ``min_version``.
        dropped_groups: groups not sampled because the loaded weights were older than ``min_version``.
        timings: seconds spent per pipeline stage during the call (``recv_obs``, ``inference``,
            ``send_actions``; a manager with step threads adds ``wait``, the caller's wait for their turns, and
            its stage seconds add up over its threads, so they can exceed the call's wall time).
        inference_batch: observations in the call's forward passes (step managers; 0 when none ran).
        forward_passes: forward passes the call ran (more than one when step threads acted several turns
            since the last call).
        events: human-readable notes worth logging (e.g. an environment process restarted).
        metrics: flat numbers for the worker's tracker (e.g. the environment's own metrics).
        stats: summary of the groups sampled (group managers; ``None`` from step managers), what the worker
            reports to the curriculum and logs.
    """

    items: list[Group] | list[SampleFragment] = field(default_factory=list)
    episodes: list[EpisodeResult] = field(default_factory=list)
    env_steps: int = 0
    dropped_steps: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    inference_batch: int = 0
    forward_passes: int = 1
    events: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    dropped_groups: int = 0
    stats: GroupStats | None = None


@runtime_checkable
class RolloutManager(Protocol):
    """Produces experience; knows nothing of weight transport, storage or logging."""

    def sample_batch(self, request: SampleRequest) -> SampleResult:
        """Do one unit of work: one inference batch for step environments, one lesson's groups for group ones."""
        ...

    def update_model(self, weights: Mapping[str, np.ndarray]) -> None:
        """Load new policy weights; takes effect for the next action chosen."""
        ...

    def shutdown(self) -> None:
        """Release processes and other resources; idempotent."""
        ...


@runtime_checkable
class EnvProcessManager(RolloutManager, Protocol):
    """A manager that runs its environments in processes of its own (the step manager): the worker reports their
    process ids and restarts in its ``info``."""

    def env_pids(self) -> list[int | None]:
        """Process ids of the environment processes (none when the environments run inline)."""
        ...

    def env_restarts(self) -> int:
        """Environment instance restarts so far."""
        ...


@runtime_checkable
class SubscribingManagerFactory(Protocol):
    """A ``worker_id -> RolloutManager`` factory whose managers sample a policy that gets its weights elsewhere (an
    inference engine the trainer pushes each version into): it names each worker's weight subscriber, which reads
    the version loaded there instead of being offered updates."""

    def __call__(self, worker_id: str) -> RolloutManager:
        """The manager of ``worker_id``."""
        ...

    def subscriber(self, worker_id: str) -> WeightSubscriber:
        """The weight subscriber of ``worker_id``."""
        ...


@runtime_checkable
class NewestVersionSubscriber(WeightSubscriber, Protocol):
    """A subscriber that knows the newest version there is, loaded or not: a worker measures its staleness bound
    from it (a subscriber without it: from the version loaded)."""

    @property
    def offered_version(self) -> int | None:
        """The newest version there is (``None`` before the first)."""
        ...


@runtime_checkable
class OfferedSubscriber(NewestVersionSubscriber, Protocol):
    """A subscriber the fleet hands each published update to (:class:`~rollhub.weights.base.OfferedWeightSubscriber`
    and the Ray fleet's subclass): what :meth:`RolloutWorker.offer_weights` needs."""

    def offer(self, version: int, payload: Any) -> None:
        """Keep ``payload`` as the newest update when ``version`` is newer than the one held."""
        ...


@runtime_checkable
class StepPolicy(Protocol):
    """A policy the step manager can run batched inference with (CPU numpy in, numpy out)."""

    def act(self, obs: np.ndarray, state: np.ndarray | None) -> PolicyStep:
        """Sample actions for a batch of observations (``state``: stacked recurrent states or ``None``)."""
        ...

    def value(self, obs: np.ndarray) -> np.ndarray:
        """Value estimates for a batch of observations (used for the final observation of a cut episode)."""
        ...

    def initial_state(self) -> np.ndarray | None:
        """The recurrent state at the start of an episode (``None`` for feed-forward policies)."""
        ...

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Replace the parameters with ``weights`` (names as the trainer's ``state_dict``)."""
        ...


@runtime_checkable
class ExperienceWriter(Protocol):
    """Where a worker's sender thread puts finished items (the replay-buffer actor, a file, a test list)."""

    def write(self, items: list[Any]) -> None:
        """Store ``items``; raise :class:`rollhub.errors.QueueFull` to ask the sender to retry later."""
        ...

    def close(self) -> None:
        """Flush and release resources."""
        ...


@dataclass(frozen=True, slots=True)
class Backlog:
    """What waits at a writer's destination: ``queued`` groups not yet served to the trainer, the trainer's
    latest published ``policy_version`` and ``next_batch_version``, the version it will train the next batch
    served at (one more than ``policy_version`` while it learns from a batch it was served since publishing it);
    ``None`` when the destination does not know them (then ``next_batch_version`` is taken to be
    ``policy_version``)."""

    queued: int
    policy_version: int | None = None
    next_batch_version: int | None = None

    @property
    def upcoming_version(self) -> int | None:
        """``next_batch_version`` where the destination reports it, else ``policy_version``."""
        return self.policy_version if self.next_batch_version is None else self.next_batch_version


@runtime_checkable
class BacklogWriter(ExperienceWriter, Protocol):
    """A writer that can tell what waits at its destination (the buffer server's queue): what a worker's
    admission control reads (``RolloutWorkerConfig.admission_batch``)."""

    def backlog(self) -> Backlog:
        """The destination's queue and the trainer's version."""
        ...


@runtime_checkable
class EpisodeHistory(Protocol):
    """Where a fleet's workers record finished episodes, read by the run that trains on them."""

    def history(self, start: int = 0) -> list[Any]:
        """Episodes with ``index >= start``, in the order they were recorded."""
        ...


@runtime_checkable
class Fleet(Protocol):
    """What every rollout fleet offers the run that drives it: the Ray fleet's
    :class:`~rollhub.rollout.backends.ray.FleetClient`, the thread fleet
    :class:`~rollhub.rollout.backends.local.LocalFleet` and the process fleet
    :class:`~rollhub.rollout.backends.processes.ProcessFleet`."""

    def publish(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        """Offer ``weights`` as ``version`` to every worker (and to the replacements of workers that fail)."""
        ...

    def statistics(self) -> EpisodeHistory:
        """The episode statistics every worker records to."""
        ...

    def curriculum(self) -> Any:
        """The fleet's shared curriculum actor handle (``None`` without a curriculum)."""
        ...

    def status(self) -> dict[str, Any]:
        """Every worker's ``info``, restarts, events and the summed pipeline timings."""
        ...

    def check(self) -> None:
        """Raise :class:`~rollhub.rollout.backends.base.FleetError` when the fleet cannot produce any more."""
        ...

    def stop(self) -> list[dict[str, Any]]:
        """Stop every worker (each sender drains first); return their final ``info``."""
        ...
