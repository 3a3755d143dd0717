"""What every fleet backend shares: :class:`FleetConfig`, :class:`FleetError` and the rule for when a fleet cannot
produce any more.

The backends (:mod:`rollhub.rollout.backends.local`, :mod:`rollhub.rollout.backends.processes` and
:mod:`rollhub.rollout.backends.ray`) take the same config and raise the same error, so the trainer's side does not
depend on which one runs. Nothing here imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rollhub.errors import ConfigError, RollhubError
from rollhub.rollout.worker import RolloutWorkerConfig


class FleetError(RollhubError):
    """The fleet is dead, does not answer, or cannot produce any more; the message says what the trainer should do."""


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
