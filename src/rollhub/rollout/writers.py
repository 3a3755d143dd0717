"""Writers: where a RolloutWorker's sender thread puts finished items.

:class:`ActorWriter` calls ``add(items)`` on a Ray actor (the replay buffer of :mod:`rollhub.rollout.replay`,
or any actor with that method) and turns the actor's :class:`rollhub.errors.RollhubError` back into the
original exception, so ``QueueFull`` reaches the sender's retry loop unchanged.
"""

from __future__ import annotations

from typing import Any

import ray

from rollhub.errors import RollhubError


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
