"""`FileBatchWriter`: a RolloutWorker's writer to JSON-lines rollout files, for offline evaluation and replay.

It adapts :class:`~rollhub.rollout.group_writers.FileRolloutWriter` (one line per
:class:`~rollhub.rollout_types.RolloutBatch`, read back exactly by ``read_rollout_batches``) to the worker's
``write(items)`` / ``close()`` protocol. Built in the driver and pickled into each worker, it opens its file on
first use; ``{pid}`` in the path gives every worker process a file of its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rollhub.rollout.group_writers import FileRolloutWriter, RolloutFileError
from rollhub.rollout_types import RolloutBatch


class FileBatchWriter:
    """Appends every RolloutBatch the worker produces to a rollout file.

    Args:
        path: the file; ``{pid}`` is replaced by the writing process's id.
        fsync: fsync after every batch (survives a machine crash, at a cost per batch).
    """

    def __init__(self, path: str | os.PathLike[str], fsync: bool = False) -> None:
        self.path = str(path)
        self.fsync = fsync
        self._writer: FileRolloutWriter | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None}

    def resolved_path(self) -> Path:
        """The file this process writes."""
        return Path(self.path.replace("{pid}", str(os.getpid())))

    def write(self, items: list[Any]) -> None:
        """Append each batch as one line.

        Raises:
            RolloutFileError: an item is not a RolloutBatch.
        """
        if self._writer is None:
            self._writer = FileRolloutWriter(self.resolved_path(), fsync=self.fsync)
        for i, batch in enumerate(items):
            if not isinstance(batch, RolloutBatch):
                raise RolloutFileError(
                    f"FileBatchWriter writes RolloutBatch objects, got {type(batch).__name__} at {i}"
                )
            self._writer.write_batch(batch)

    def close(self) -> None:
        """Close the file (a later write opens it again, appending)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
