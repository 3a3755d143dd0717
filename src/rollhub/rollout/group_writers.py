"""Rollout batches to files, for offline evaluation and replay; and back.

:class:`FileRolloutWriter` appends one JSON line per :class:`~rollhub.rollout_types.RolloutBatch`:
``{"lesson_id", "metadata": {worker_id, timestamp, weight_step}, "items": [scored-data items]}``. Items are in
the buffer server's format, so a file can be replayed into a server or fed straight to the GRPO trainer.
JSON keeps every float exactly, so :func:`read_rollout_batches` returns batches equal to those written.

Each line is flushed (and fsynced if asked) as it is written; after a crash only the last line can be torn,
and the reader skips a torn last line while refusing a corrupt line anywhere else.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from rollhub.errors import RollhubError
from rollhub.rollout_types import RolloutBatch, RolloutMetadata

logger = logging.getLogger(__name__)


class RolloutFileError(RollhubError):
    """A rollout file that cannot be written or holds a corrupt line."""


class FileRolloutWriter:
    """Appends rollout batches to a JSON-lines file.

    Args:
        path: the file (parent directories are created; an existing file is appended to).
        fsync: fsync after every batch, so a batch written survives a machine crash.
    """

    def __init__(self, path: str | os.PathLike[str], fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._fh: Any = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.batches_written = 0

    def write_batch(self, batch: RolloutBatch) -> None:
        """Append one batch as one line.

        Raises:
            RolloutFileError: the writer is closed.
        """
        if self._fh is None:
            raise RolloutFileError(f"writer for {self.path} is closed; open a new FileRolloutWriter")
        meta = batch.metadata
        record = {
            "lesson_id": batch.lesson_id,
            "metadata": {
                "worker_id": meta.worker_id,
                "timestamp": meta.timestamp,
                "weight_step": meta.weight_step,
            },
            "items": batch.to_items(),
        }
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._fh.flush()
        if self._fsync:
            os.fsync(self._fh.fileno())
        self.batches_written += 1

    def close(self) -> None:
        """Flush and close; closing twice is harmless."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> FileRolloutWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_rollout_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The raw records of a rollout file, in write order (a torn final line is skipped with a warning).

    Raises:
        RolloutFileError: a line other than the last is not valid JSON.
    """
    with open(path, encoding="utf-8") as fh:
        lines = fh.readlines()
    for i, line in enumerate(lines):
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1 and not line.endswith("\n"):
                logger.warning("skipping torn last line %d of %s", i + 1, path)
                return
            raise RolloutFileError(f"line {i + 1} of {path} is not valid JSON ({exc}); the file is corrupt") from None


def read_rollout_batches(path: str | os.PathLike[str]) -> Iterator[RolloutBatch]:
    """The batches of a rollout file, equal to those written."""
    for record in read_rollout_records(path):
        meta = record["metadata"]
        metadata = RolloutMetadata(meta["worker_id"], float(meta["timestamp"]), int(meta["weight_step"]))
        yield RolloutBatch.from_items(record["items"], metadata, record["lesson_id"])
