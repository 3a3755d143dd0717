"""What travels from the trainer to the rollout side (a versioned :class:`WeightUpdate`) and the two roles.

A transport decides how an update travels (Ray object store, checkpoint directory); the roles stay the same:
the trainer's :class:`WeightPublisher` publishes version ``v`` after its ``v``-th optimizer step, and every
rollout process holds a :class:`WeightSubscriber` that it polls between inference batches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rollhub.errors import InvalidInput


@dataclass(frozen=True)
class WeightUpdate:
    """A full set of policy parameters and the version they are.

    Attributes:
        version: the trainer step whose weights these are (``policy_version`` of data produced with them).
        weights: parameter arrays by name (the trainer's ``state_dict`` names).
        created_at: UNIX time of publication.
    """

    version: int
    weights: Mapping[str, np.ndarray]
    created_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.version < 0:
            raise InvalidInput(f"weight version must be >= 0, got {self.version}", field="version")

    @property
    def nbytes(self) -> int:
        """Total size of the parameter arrays in bytes."""
        return int(sum(np.asarray(a).nbytes for a in self.weights.values()))


def check_newer(version: int, last: int | None) -> None:
    """What every publisher checks before it publishes ``version`` (``last``: the version it published last).

    Raises:
        InvalidInput: ``version`` is not newer than ``last``.
    """
    if last is not None and version <= last:
        raise InvalidInput(
            f"weight version {version} is not newer than the last published {last}; publish increasing versions",
            field="version",
        )


@runtime_checkable
class WeightPublisher(Protocol):
    """The trainer side: makes a new version available to every subscriber."""

    def publish(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        """Publish ``weights`` as ``version``; versions must increase."""
        ...


@runtime_checkable
class WeightSubscriber(Protocol):
    """The rollout side: hands out the newest version not yet loaded."""

    @property
    def loaded_version(self) -> int | None:
        """The version last returned by :meth:`poll` (``None`` before the first)."""
        ...

    def poll(self) -> WeightUpdate | None:
        """Return the newest update newer than :attr:`loaded_version`, or ``None``; never waits for one."""
        ...


class OfferedWeightSubscriber:
    """A subscriber that is handed its updates (``offer``) and keeps the newest; :meth:`poll` returns it once.
    Thread-safe: the fleet offers from its thread while the worker polls from its loop.

    What a worker of the local and process fleets holds; the Ray fleet's
    :class:`~rollhub.weights.ray_transport.RayWeightSubscriber` is offered object references instead and fetches
    the update behind one when it is polled (:meth:`_fetch`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offered: tuple[int, Any] | None = None
        self._loaded: int | None = None

    @property
    def loaded_version(self) -> int | None:
        """The version last returned by :meth:`poll`."""
        return self._loaded

    @property
    def offered_version(self) -> int | None:
        """The newest version offered so far (maybe not loaded yet)."""
        with self._lock:
            return None if self._offered is None else self._offered[0]

    def offer(self, version: int, payload: Any) -> None:
        """Remember ``payload`` as the newest update if ``version`` is newer than what is held."""
        with self._lock:
            if self._offered is None or version > self._offered[0]:
                self._offered = (version, payload)

    def poll(self) -> WeightUpdate | None:
        """Return the newest offered update when it is newer than the loaded one, else ``None``."""
        with self._lock:
            offered = self._offered
        if offered is None or (self._loaded is not None and offered[0] <= self._loaded):
            return None
        version, payload = offered
        update = self._fetch(payload)
        self._loaded = version
        return update

    def _fetch(self, payload: Any) -> WeightUpdate:
        """The update an offered ``payload`` stands for: here the :class:`WeightUpdate` itself."""
        return payload


class FanOutPublisher:
    """One :class:`WeightPublisher` that publishes every version to several (e.g. the fleet and a checkpoint
    directory), in order; the first failure propagates."""

    def __init__(self, *publishers: WeightPublisher) -> None:
        self.publishers = publishers

    def publish(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        """Publish ``weights`` as ``version`` to every publisher."""
        for publisher in self.publishers:
            publisher.publish(version, weights)
