"""The one staleness clock: how far behind the trainer a piece of experience may be.

``policy_version`` counts the weights the trainer has published: the initial weights are version 0 and every
optimizer update the trainer publishes adds one. Every producer tags what it makes with the version it had
*loaded* when it acted; the producers' admission and the buffer compare that tag against the trainer's
current version with the same :class:`StalenessPolicy`, so one ``max_staleness`` means one thing everywhere, and
the trainer measures its lag (:meth:`StalenessPolicy.lag`) on the same clock. The bound is applied once per path
before a batch is served (the buffer's guard); a trainer trains on what it is served.

An item of version ``p`` is *fresh* at trainer version ``v`` when ``v - p <= max_staleness``. Items with no
version (Atropos clients that never send one) are always fresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollhub.errors import ConfigError


@dataclass(frozen=True)
class StalenessPolicy:
    """The staleness bound shared by the workers and the buffer, and the clock the trainer measures lag on.

    Attributes:
        max_staleness: the largest ``trainer_version - policy_version`` still used; ``None``: no bound.
    """

    max_staleness: int | None = None

    def __post_init__(self) -> None:
        if self.max_staleness is not None and (isinstance(self.max_staleness, bool) or self.max_staleness < 0):
            raise ConfigError(
                f"max_staleness is {self.max_staleness!r}; give a whole number >= 0, or None for no bound",
                field="max_staleness",
            )

    @property
    def bounded(self) -> bool:
        return self.max_staleness is not None

    def oldest_fresh(self, current_version: int) -> int | None:
        """The oldest ``policy_version`` still fresh at ``current_version`` (``None``: every version is)."""
        return None if self.max_staleness is None else current_version - self.max_staleness

    def lag(self, policy_version: int | None, current_version: int) -> int:
        """``current_version - policy_version`` (0 for unversioned items)."""
        return 0 if policy_version is None else current_version - int(policy_version)

    def is_stale(self, policy_version: int | None, current_version: int) -> bool:
        """Whether an item of ``policy_version`` is too old to use at ``current_version``."""
        floor = self.oldest_fresh(current_version)
        return floor is not None and policy_version is not None and int(policy_version) < floor

    def fresh_mask(self, policy_versions: np.ndarray, current_version: int) -> np.ndarray:
        """Element-wise :meth:`is_stale` negated, for an int array of versions (``-1``: unversioned)."""
        versions = np.asarray(policy_versions)
        floor = self.oldest_fresh(current_version)
        if floor is None:
            return np.ones(versions.shape, dtype=bool)
        return (versions < 0) | (versions >= floor)
