"""`FileBatchWriter`: a RolloutWorker's writer to JSON-lines rollout files, for offline evaluation and replay.

It adapts :class:`~rollhub.rollout.group.files.FileRolloutWriter` (one line per ``write`` of
:class:`~rollhub.experience.Group` objects, read back exactly by ``read_rollout_groups``) to the worker's
``write(items)`` / ``close()`` protocol. Built in the driver and pickled into each worker, it opens its file
on first use; ``{pid}`` in the path gives every worker process a file of its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rollhub.experience import Group
from rollhub.rollout.group.files import FileRolloutWriter


class FileBatchWriter:
    """Appends every group the worker produces to a rollout file.

    Args:
        path: the file; ``{pid}`` is replaced by the writing process's id.
        fsync: fsync after every write (survives a machine crash, at a cost per write).
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

    def write(self, items: list[Group]) -> None:
        """Append the groups as one line.

        Raises:
            RolloutFileError: an item is not a ``Group``.
        """
        if self._writer is None:
            self._writer = FileRolloutWriter(self.resolved_path(), fsync=self.fsync)
        self._writer.write(items)

    def close(self) -> None:
        """Close the file (a later write opens it again, appending)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
