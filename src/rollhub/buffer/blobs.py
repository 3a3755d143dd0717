"""Append-only segment files for large payloads, beside the SQLite index (:class:`BlobLog`).

A group of 16 x 2048 tokens is a 400 KB blob. Written into SQLite it costs page copies, WAL frame checksums and,
at the next checkpoint, a second copy into the database file: 0.35 ms per group before the checkpoint. Appended to
a segment file it is one ``write`` (0.08 ms), and SQLite keeps a small row saying where it lives. A segment is
deleted once no stored item points into it; the active one rolls over at ``segment_bytes``.

Ordering gives the crash guarantees: the bytes are written before the row that points at them commits, so after a
crash of the process every committed row finds its bytes (they are in the page cache); bytes whose row never
committed are dead space, dropped with their segment. With ``sync=True`` each append is flushed to disk before the
commit, so the same holds after a power loss.

A failed write cannot misplace later ones: each blob is written with ``pwrite`` at the offset the log records, and
a write that fails part way (a full disk) is cut off again (``ftruncate`` to the last good size), so the next blob
goes where the log says it is. A consumed blob's blocks are given back at once (a hole punched in its segment),
so consumption frees space even in the segment still being written.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from rollhub.buffer.space import is_disk_full, punch_hole
from rollhub.errors import StorageError, StorageFull

Location = tuple[int, int, int]  # segment, offset, length

_SUFFIX = ".seg"


class BlobLog:
    """Segment files ``NNNNNNNN.seg`` in ``directory``; locations are ``(segment, offset, length)``.

    Not thread-safe by itself: the owning storage calls it under its write lock (reads may come from any thread).

    Args:
        directory: where the segments live (created if missing).
        segment_bytes: the active segment rolls over once it holds this much.
        sync: flush each append to disk (``fdatasync``) before returning.

    Attributes:
        pwrite: the write primitive, ``os.pwrite`` unless replaced (a test's disk that fills up, for one).
    """

    def __init__(self, directory: Path, segment_bytes: int = 256 * 2**20, sync: bool = False) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.sync = sync
        self.live: Counter[int] = Counter()  # segment -> stored items pointing into it
        self._active = -1
        self._fd = -1
        self._size = 0
        self._readers: dict[int, int] = {}
        self._read_lock = threading.Lock()
        self.pwrite = os.pwrite

    def _path(self, segment: int) -> Path:
        return self.directory / f"{segment:08d}{_SUFFIX}"

    def open(self, live: Counter[int]) -> None:
        """Start after a load: keep the segments in ``live``, delete the rest, open a fresh active segment."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.live = Counter({s: n for s, n in live.items() if n > 0})
        existing = [int(p.stem) for p in self.directory.glob(f"*{_SUFFIX}") if p.stem.isdigit()]
        for segment in existing:
            if segment not in self.live:
                self._path(segment).unlink(missing_ok=True)
        self._roll(max([*existing, -1]) + 1)

    def size_of(self, segment: int) -> int:
        """Bytes in ``segment`` on disk (0 when it is missing)."""
        try:
            return self._path(segment).stat().st_size
        except FileNotFoundError:
            return 0

    def _roll(self, segment: int) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._active = segment
        self._fd = os.open(self._path(segment), os.O_RDWR | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size

    def mark(self) -> Location:
        """Where the next append goes, for :meth:`rollback`."""
        return self._active, self._size, 0

    def append(self, data: bytes | memoryview) -> Location:
        """Write ``data`` at the end of the active segment and return its location; all of it or nothing.

        Raises:
            StorageFull: the disk has no room (the segment is cut back to its last good size).
            StorageError: any other write failure (likewise cut back).
        """
        try:
            if self._size >= self.segment_bytes or self._fd < 0:
                self._roll(self._active + 1)
        except OSError as exc:
            raise self._error(exc) from exc
        view = memoryview(data).cast("B")
        offset = self._size
        try:
            written = 0
            while written < len(view):
                n = self.pwrite(self._fd, view[written:], offset + written)
                if n <= 0:
                    raise OSError(errno.EIO, f"write returned {n}")
                written += n
            if self.sync:
                os.fdatasync(self._fd)
        except OSError as exc:
            self._cut(offset)
            raise self._error(exc) from exc
        self._size += len(view)
        return self._active, offset, len(view)

    def _error(self, exc: OSError) -> StorageError:
        where = self._path(self._active)
        if is_disk_full(exc):
            return StorageFull(f"no space left on the disk holding {where}; free space or consume data, then retry")
        return StorageError(f"cannot write to {where}: {exc}")

    def _cut(self, size: int) -> None:
        """Cut the active segment back to ``size`` bytes (shrinking needs no space)."""
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            # the tail past ``size`` stays but is never pointed at: the next blob is written at ``size``
            pass

    def rollback(self, mark: Location) -> None:
        """Undo every append since :meth:`mark` (their transaction did not commit)."""
        segment, size, _ = mark
        if self._active == segment:
            self._cut(size)
            self._size = size
            return
        for newer in range(segment + 1, self._active + 1):  # segments begun by the failed transaction
            if newer not in self.live:
                self._delete(newer)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self._roll(segment)
            self._cut(size)
            self._size = size
        except OSError:
            self._fd = -1  # the next append opens a fresh segment

    def read(self, segment: int, offset: int, length: int) -> bytes:
        """The bytes at a location (any thread)."""
        with self._read_lock:
            fd = self._readers.get(segment)
            if fd is None:
                try:
                    fd = os.open(self._path(segment), os.O_RDONLY)
                except FileNotFoundError:
                    raise StorageError(f"blob segment {self._path(segment)} is missing") from None
                self._readers[segment] = fd
            data = os.pread(fd, length, offset)
        if len(data) != length:
            raise StorageError(f"blob segment {self._path(segment)} ends before {offset + length}")
        return data

    def committed(self, added: Iterable[int], released: Iterable[Location], *, cleared: bool = False) -> None:
        """After a commit: count the new items per segment, free released blobs, delete dead segments.

        ``released`` are the locations of blobs no stored item points at any more: a segment left with no item is
        deleted, and in one that lives on (the active one, say) the blob's blocks are punched out.
        ``cleared``: the transaction removed every earlier item (after :meth:`clear`), so every segment before the
        active one that holds no new item is dead.
        """
        if cleared:
            self.live.clear()
        self.live.update(added)
        released = list(released)
        self.live.subtract(segment for segment, _, _ in released)
        for segment in [s for s, n in self.live.items() if n <= 0]:
            del self.live[segment]
            if segment != self._active:
                self._delete(segment)
        for segment, offset, length in released:
            if segment in self.live or segment == self._active:
                self._punch(segment, offset, length)
        if cleared:
            for path in self.directory.glob(f"*{_SUFFIX}"):
                segment = int(path.stem) if path.stem.isdigit() else -1
                if segment < self._active and segment not in self.live:
                    self._delete(segment)

    def _punch(self, segment: int, offset: int, length: int) -> None:
        if segment == self._active and self._fd >= 0:
            punch_hole(self._fd, offset, length)
            return
        try:
            fd = os.open(self._path(segment), os.O_WRONLY)
        except OSError:
            return
        try:
            punch_hole(fd, offset, length)
        finally:
            os.close(fd)

    def clear(self) -> None:
        """Start a new active segment, so a clearing transaction's own items never share one with the dead."""
        try:
            self._roll(self._active + 1)
        except OSError as exc:
            raise self._error(exc) from exc

    def _delete(self, segment: int) -> None:
        with self._read_lock:
            fd = self._readers.pop(segment, None)
            if fd is not None:
                os.close(fd)
        self._path(segment).unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with self._read_lock:
            for fd in self._readers.values():
                os.close(fd)
            self._readers.clear()
