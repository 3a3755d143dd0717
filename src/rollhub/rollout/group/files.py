"""Groups to files, for offline evaluation and replay; and back.

:class:`FileRolloutWriter` appends one JSON line per :meth:`~FileRolloutWriter.write` call:
``{"items": [scored-data items]}``, one Atropos item per :class:`~rollhub.experience.Group` (its
``policy_version``, worker id, env name, example id and timestamp included, see
:mod:`rollhub.envs.group.scored`). Items are in the buffer server's format, so a file can be replayed into a
server or read straight into the GRPO trainer. JSON keeps every float exactly, so :func:`read_rollout_groups`
returns groups whose items equal those written.

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

import orjson

from rollhub.errors import RollhubError
from rollhub.experience import Group
from rollhub.wire.group import group_from_json, group_to_item

logger = logging.getLogger(__name__)


class RolloutFileError(RollhubError):
    """A rollout file that cannot be written or holds a corrupt line."""


class FileRolloutWriter:
    """Appends groups to a JSON-lines file, one line per ``write`` call.

    Args:
        path: the file (parent directories are created; an existing file is appended to).
        fsync: fsync after every line, so what was written survives a machine crash.
    """

    def __init__(self, path: str | os.PathLike[str], fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._fh: Any = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.lines_written = 0
        self.groups_written = 0

    def write(self, groups: list[Group]) -> None:
        """Append ``groups`` as one line.

        Raises:
            RolloutFileError: the writer is closed, or an item is not a ``Group``.
        """
        if self._fh is None:
            raise RolloutFileError(f"writer for {self.path} is closed; open a new FileRolloutWriter")
        for i, group in enumerate(groups):
            if not isinstance(group, Group):
                raise RolloutFileError(f"FileRolloutWriter writes Group objects, got {type(group).__name__} at {i}")
        items = [group_to_item(g) for g in groups]
        self._fh.write(orjson.dumps({"items": items}, option=orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
        self._fh.flush()
        if self._fsync:
            os.fsync(self._fh.fileno())
        self.lines_written += 1
        self.groups_written += len(groups)

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


def read_rollout_groups(path: str | os.PathLike[str]) -> Iterator[list[Group]]:
    """The groups of each line of a rollout file, in write order, as written."""
    for record in read_rollout_records(path):
        yield [group_from_json(item) for item in record["items"]]
