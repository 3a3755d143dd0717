"""The replay buffer of the step path: the buffer table (:class:`rollhub.buffer.Table`) with the fragment
batch rule (:class:`rollhub.buffer.FragmentRule`), run in the trainer's process or as a Ray actor.

It is the same table the Atropos buffer is built on (same storage, staleness gate, admission and serving), with
fragments in place of scored groups and no environment registry. Items are :class:`SampleFragment`s, each counted
as one sequence and stamped with its *oldest* step version, so the table's per-item staleness gate
(:class:`rollhub.experience.StalenessPolicy`) covers every step: with
``max_staleness = k``, the batch served as trainer step ``s`` only holds fragments whose every step was chosen by
version ``s - k`` or newer. A trainer that publishes version ``s + 1`` after consuming the batch of step ``s``
therefore never trains on a step more than ``k`` versions older than the weights it holds. A trainer whose
versions do not follow its steps tells the buffer with :meth:`ReplayBuffer.publish_version`; from then on the
bound compares against the published version.

The Ray fleet runs it as an actor (:func:`rollhub.rollout.backends.ray.start_replay_buffer`); the local and
process fleets hold it in the trainer's process.

With SQLite storage the actor can outlive its process and its node: every ``add`` returns only after the
fragments are committed to the file, so an actor started with ``max_restarts`` comes back (on whichever node Ray
restarts it) with every fragment it acknowledged still queued, and its step counter where it was.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import asdict
from typing import Any

from rollhub.buffer import Batch, BufferConfig, FragmentRule, Table, TrainerRun, VersionPublished
from rollhub.errors import ConfigError, InvalidInput, QueueFull
from rollhub.experience import SampleFragment
from rollhub.rollout.step.fragment_store import make_fragment_storage


class PartialWrite(QueueFull):
    """The buffer took the first ``accepted`` items and refused the rest; retry the rest after a pause."""

    def __init__(self, message: str, *, retry_after_s: float, accepted: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s, accepted=accepted)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments: rebuild explicitly so the error survives pickling across Ray processes.
        return (_partial_write, (self.message, self.retry_after_s, self.accepted))


def _partial_write(message: str, retry_after_s: float, accepted: int) -> PartialWrite:
    return PartialWrite(message, retry_after_s=retry_after_s, accepted=accepted)


def _ray_node_id() -> str | None:
    """The Ray node this process runs on; ``None`` outside Ray. Ray is only asked when something already imported
    it (a process that never did runs no Ray), so the buffer imports no Ray itself."""
    ray = sys.modules.get("ray")
    return ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None


def _picklable(value: Any) -> None:
    """Raise if ``value`` cannot cross to another process (array data is referenced, not copied)."""
    pickle.dumps(value, protocol=5, buffer_callback=lambda _: None)


def _check_fragment(fragment: Any, index: int, pickles: bool) -> None:
    """Admit only fragments the trainer can be sent: a :class:`SampleFragment` (that pickles, if ``pickles``)."""
    if not isinstance(fragment, SampleFragment):
        raise InvalidInput(
            f"items[{index}] is a {type(fragment).__name__}; the replay buffer takes SampleFragment items",
            field="items",
            index=index,
        )
    if not pickles:
        return
    try:
        _picklable(fragment)
    except Exception as exc:
        raise InvalidInput(
            f"items[{index}] cannot be sent to another process ({type(exc).__name__}: {exc}); "
            "keep fragments to arrays and plain values",
            field="items",
            index=index,
        ) from None


def _in_place(batch: Batch) -> Batch:
    """The served batch as it is, for a trainer in the buffer's own process."""
    return batch


def _encode(batch: Batch) -> Batch:
    """The served batch, checked to pickle before the table commits it as served (else it is put back)."""
    _picklable(batch)
    return batch


class ReplayBuffer:
    """Fragments in, batches of ``batch_size`` fragments out, with the table's staleness gate and admission.

    Args:
        batch_size: fragments per batch.
        max_staleness: the largest ``trainer version - policy_version`` a served fragment may have, against the
            version given to :meth:`publish_version` (before the first, the count of batches served).
        max_queued: refuse (``QueueFull``) fragments beyond this many waiting; ``None``: unbounded.
        storage: ``memory`` (the default) or ``sqlite:///path.db``: durable; a buffer opened on an existing file
            resumes its queue and step (see :func:`rollhub.rollout.step.fragment_store.make_fragment_storage`).
        starting_step: the trainer step of the first batch of a new file (an existing run keeps its step).
        in_process: the trainer reads the buffer in its own process (the local and process fleets), so batches
            are not checked to pickle, nor, with memory storage, the fragments added. ``False`` (a Ray actor, the
            default): both are, so nothing is queued or served that cannot cross to the other side.
    """

    def __init__(
        self,
        batch_size: int,
        max_staleness: int,
        max_queued: int | None = None,
        storage: str = "memory",
        starting_step: int = 0,
        in_process: bool = False,
    ) -> None:
        if max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {max_staleness}")
        config = BufferConfig(max_staleness=max_staleness, max_queued_sequences=max_queued, retry_after_s=0.05)
        self.table = Table(make_fragment_storage(storage), config, rule=FragmentRule())
        self.table.register_trainer(TrainerRun(batch_size=batch_size, starting_step=starting_step))
        self._pickles = not in_process or storage != "memory"  # stored or sent: fragments must pickle
        self._encode = _in_place if in_process else _encode

    def add(self, items: list[SampleFragment]) -> int:
        """Queue fragments in order; returns how many were queued.

        Raises:
            InvalidInput: an item is not a picklable :class:`SampleFragment` (nothing was queued).
            PartialWrite: the queue filled up after ``accepted`` items; resend the rest later.
        """
        for i, fragment in enumerate(items):  # all checked before any is queued
            _check_fragment(fragment, i, self._pickles)
        for i, fragment in enumerate(items):
            try:
                self.table.put(fragment, size=1, policy_version=fragment.min_version)
            except QueueFull as exc:
                raise PartialWrite(
                    f"replay buffer full after {i} of {len(items)} fragments: {exc.message}",
                    retry_after_s=exc.retry_after_s,
                    accepted=i,
                ) from None
        return len(items)

    def next_batch(self, wait_s: float = 0.0) -> Batch | None:
        """The next batch, waiting up to ``wait_s`` seconds for enough fresh fragments; else ``None``.

        It is the table's served batch (:class:`rollhub.buffer.Batch`), the one type from this buffer to the
        trainer's source: ``step`` is the trainer step it counts as, ``items`` its fragments, oldest first.

        The batch is taken off the table's queue only once it is built and (unless ``in_process``) known to pickle, the
        form in which it leaves the actor; if that fails it stays first in line and the error propagates.
        """
        return self.table.serve_batch(self._encode, wait_s=wait_s)

    def publish_version(self, version: int) -> VersionPublished:
        """The trainer now holds policy ``version``: the staleness bound compares against it from now on, and
        fragments too stale for it are dropped at once (see :meth:`rollhub.buffer.Table.publish_version`)."""
        return self.table.publish_version(version)

    def status(self) -> dict[str, Any]:
        """The table's status (``current_step``, ``queue_size``, ``stale_dropped``, queue bounds, ``policy_version``),
        fragments added by this process (``added``), and the Ray node it runs on (``node_id``, ``None`` outside
        Ray)."""
        status = asdict(self.table.status())
        status["stale_dropped_total"] = int(sum(status["stale_dropped"].values()))
        status["added"] = self.table.counters.sequences_in
        status["node_id"] = _ray_node_id()
        return status
