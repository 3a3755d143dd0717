"""The buffer's staleness clock: which trainer version the staleness bound compares items against.

The rule itself is :class:`rollhub.experience.StalenessPolicy` (an item of version ``p`` is fresh at trainer
version ``v`` when ``v - p <= max_staleness``). What ``v`` is depends on the trainer:

* once the trainer has published a policy version (``POST /policy-version``, :meth:`StalenessClock.publish`),
  ``v`` is the latest published version;
* before any publish (a plain AtroposLib trainer, which never does), ``v`` is the buffer's ``current_step``
  (batches served), as in earlier releases.

Published versions never go backwards; the coordinator persists the latest in the storage meta.
"""

from __future__ import annotations

from rollhub.buffer.queue import Queue
from rollhub.buffer.storage import Entry
from rollhub.errors import InvalidInput, VersionConflict
from rollhub.experience import StalenessPolicy


class StalenessClock:
    """The staleness policy and the latest published policy version (``None`` until the first publish)."""

    def __init__(self, policy: StalenessPolicy, published: int | None = None) -> None:
        self.policy = policy
        self.published = published

    def reference(self, step: int) -> int:
        """The trainer version items are compared against: the published version, else ``step``."""
        return step if self.published is None else self.published

    def check(self, version: object) -> int:
        """``version`` as a new published version, or raise without changing anything.

        Raises:
            InvalidInput: not a whole number >= 0.
            VersionConflict: lower than the version already published.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidInput(
                f"policy_version is {version!r}; send the number of weight updates published, a whole number >= 0",
                field="policy_version",
            )
        if self.published is not None and version < self.published:
            raise VersionConflict(
                f"policy_version {version} is lower than the version already published ({self.published}); "
                "versions only go forward: send the trainer's current version, or reset the run",
                field="policy_version",
            )
        return version

    def drop_stale(self, queue: Queue, step: int) -> list[Entry]:
        """Take every item too stale at the reference version off ``queue`` and return them."""
        floor = self.policy.oldest_fresh(self.reference(step))
        return [] if floor is None else queue.drop_older_than(floor)
