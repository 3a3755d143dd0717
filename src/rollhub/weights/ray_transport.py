"""Weight broadcast through the Ray object store: one ``ray.put`` by the trainer, one ``ray.get`` per worker.

The publisher puts the :class:`WeightUpdate` once and hands the object reference (wrapped in a list, so Ray
passes the reference instead of the value) to a sink, normally the :class:`rollhub.rollout.backends.ray.RolloutFleet`
actor, which forwards the same reference to every worker. Each worker's :class:`RayWeightSubscriber` fetches
the newest reference when it next polls; numpy arrays are read from shared memory without a copy on the same
node. Superseded references are dropped, so old versions are freed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import ray

from rollhub.weights.base import OfferedWeightSubscriber, WeightUpdate, check_newer


class RayWeightPublisher:
    """Publishes weights to an actor exposing ``offer_weights(version, [ref])``.

    Args:
        sink: the actor handle that forwards references (the fleet), or any object with that remote method.
        timeout_s: how long to wait for the sink to accept; the sink's failure surfaces as its Ray error.
    """

    def __init__(self, sink: Any, timeout_s: float = 60.0) -> None:
        self.sink = sink
        self.timeout_s = timeout_s
        self.version: int | None = None

    def publish(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        """Put ``weights`` in the object store once and offer the reference to the sink."""
        check_newer(version, self.version)
        ref = ray.put(WeightUpdate(version, {k: np.asarray(v, order="C") for k, v in weights.items()}))
        ray.get(self.sink.offer_weights.remote(version, [ref]), timeout=self.timeout_s)
        self.version = version


class RayWeightSubscriber(OfferedWeightSubscriber):
    """Keeps the newest offered reference; :meth:`poll` fetches it once. Thread-safe.

    ``offer`` also accepts a :class:`WeightUpdate` value directly (in-process use, tests).
    """

    def offer(self, version: int, payload: list[ray.ObjectRef] | WeightUpdate) -> None:
        """Remember ``payload`` as the newest update if ``version`` is newer than what is held."""
        super().offer(version, payload)

    def _fetch(self, payload: list[ray.ObjectRef] | WeightUpdate) -> WeightUpdate:
        """The update itself, or the one behind the reference (read from shared memory on the same node)."""
        return payload if isinstance(payload, WeightUpdate) else ray.get(payload[0])
