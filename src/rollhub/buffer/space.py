"""Disk space for the SQLite backend: telling a full disk apart, a released-on-demand reserve, freeing ranges.

When the disk fills, the buffer must still serve and acknowledge (so the trainer can drain it), and each of those
is a SQLite write: WAL frames and, at the checkpoint, pages copied into the database file. :class:`SpaceReserve`
keeps a file of pre-allocated bytes beside the database; the first write that fails for want of space releases it,
which gives those small writes room, and it is taken again once the disk has room for it twice over.
:func:`punch_hole` gives the disk blocks of a consumed blob back without touching the rest of its segment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("rollhub.storage")

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_SQLITE_FULL = 13
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc: ctypes.CDLL | None = None
_can_punch = True


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (an ``OSError`` or a SQLite error, or one it was raised from) means "no space left"."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        if isinstance(exc, sqlite3.Error) and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == _SQLITE_FULL:
            return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer can still allocate on the file system holding ``directory``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Deallocate ``length`` bytes at ``offset`` of an open file, keeping its size (reads there give zeros).

    Returns False where the file system or platform cannot (the bytes then stay until the file is deleted).
    """
    global _libc, _can_punch
    if not _can_punch or length <= 0:
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        except (OSError, AttributeError):
            _can_punch = False
            return False
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if _libc.fallocate(fd, mode, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        _can_punch = False
    else:
        log.warning("cannot free %d consumed bytes at offset %d: %s", length, offset, os.strerror(err))
    return False


class SpaceReserve:
    """A file of ``nbytes`` allocated bytes that is given up when the disk fills and taken back when it has room.

    Args:
        path: the reserve file.
        nbytes: its size; 0 keeps no reserve.
    """

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.held = False
        self.free_bytes: Callable[[Path], int] = free_bytes  # replaceable, e.g. by a test's disk
        self._free_at_release = 0

    def hold(self) -> bool:
        """Allocate the reserve (again); False, with nothing left behind, when the disk has no room for it."""
        if self.held or self.nbytes == 0:
            self.held = True
            return True
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(fd, 0, self.nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            if is_disk_full(exc):
                return False
            raise
        self.held = True
        return True

    def release(self) -> None:
        """Give the reserved bytes back to the file system; the free space then is the mark to resume from."""
        self.path.unlink(missing_ok=True)
        self.held = False
        self._free_at_release = self._room()

    def _room(self) -> int:
        return self.free_bytes(self.path.parent)

    def low(self) -> bool:
        """Whether the disk is getting full (less free than four reserves, at least 4 MiB).

        Then every commit is checkpointed at once, so that the WAL never holds more new pages than the reserve
        can take when the disk does fill up (a checkpoint must write them into the database file to start the WAL
        over, and until it can, every write makes the WAL longer).
        """
        return self.free_bytes(self.path.parent) < 4 * max(self.nbytes, 1 << 20)

    def room_to_resume(self) -> bool:
        """Whether, since :meth:`release`, the disk has gained room for the reserve (at least 1 MiB) again.

        Measured from the free space left right after the release, so that a refusal is not followed at once by
        another write that fails the same way.
        """
        step = max(self.nbytes, 1 << 20)
        return self._room() >= self._free_at_release + step
