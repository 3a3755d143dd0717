"""The buffer's staleness clock: which trainer version the staleness bound compares items against.

The rule itself is :class:`rollhub.experience.StalenessPolicy` (an item of version ``p`` is fresh at trainer
version ``v`` when ``v - p <= max_staleness``). What ``v`` is depends on the trainer:

* once the trainer has published a policy version (``POST /policy-version``, :meth:`StalenessClock.publish`),
  ``v`` is the latest published version;
* before any publish (a plain AtroposLib trainer, which never does), ``v`` is the buffer's ``current_step``
  (batches served), as in earlier releases.

Published versions never go backwards; the coordinator persists the latest in the storage meta, with the
``current_step`` it was published at, from which :meth:`StalenessClock.next_batch_version` tells producers the
version the next batch will be trained at (what their admission control budgets against).
"""

from __future__ import annotations

from rollhub.buffer.queue import Queue
from rollhub.buffer.storage import Entry
from rollhub.errors import InvalidInput, VersionConflict
from rollhub.experience import StalenessPolicy


class StalenessClock:
    """The staleness policy, the latest published policy version (``None`` until the first publish) and the
    buffer's ``current_step`` when it was published (``published_step``)."""

    def __init__(self, policy: StalenessPolicy, published: int | None = None, published_step: int = 0) -> None:
        self.policy = policy
        self.published = published
        self.published_step = published_step

    def next_batch_version(self, step: int) -> int | None:
        """The version the trainer will hold when it trains on the next batch served, ``step`` being the buffer's
        ``current_step``: the published version, plus one once a batch was served since it was published (the
        trainer is learning from it and publishes the next version before it asks again). ``None`` before the
        first publish. A trainer that takes several batches per version reaches the next one later than this
        says, so budgets made against it are on the safe side."""
        if self.published is None:
            return None
        return self.published + (1 if step > self.published_step else 0)

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
