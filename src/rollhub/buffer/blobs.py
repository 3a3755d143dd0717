"""Append-only segment files for large payloads, beside the SQLite index (:class:`BlobLog`).

A group of 16 x 2048 tokens is a 400 KB blob. Written into SQLite it costs page copies, WAL frame checksums and,
at the next checkpoint, a second copy into the database file: 0.35 ms per group before the checkpoint. Appended to
a segment file it is one ``write`` (0.08 ms), and SQLite keeps a small row saying where it lives. A segment is
deleted once no stored item points into it; the active one rolls over at ``segment_bytes``.

Ordering gives the crash guarantees: the bytes are written before the row that points at them commits, so after a
crash of the process every committed row finds its bytes (they are in the page cache); bytes whose row never
committed are dead space, dropped with their segment. With ``sync=True`` each append is flushed to disk before the
commit, so the same holds after a power loss.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from rollhub.errors import StorageError

_SUFFIX = ".seg"


class BlobLog:
    """Segment files ``NNNNNNNN.seg`` in ``directory``; locations are ``(segment, offset, length)``.

    Not thread-safe by itself: the owning storage calls it under its write lock (reads may come from any thread).

    Args:
        directory: where the segments live (created if missing).
        segment_bytes: the active segment rolls over once it holds this much.
        sync: flush each append to disk (``fdatasync``) before returning.
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
        self._active = segment
        self._fd = os.open(self._path(segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size

    def append(self, data: bytes | memoryview) -> tuple[int, int, int]:
        """Write ``data`` at the end of the active segment; return its location."""
        if self._size >= self.segment_bytes:
            self._roll(self._active + 1)
        view = memoryview(data).cast("B")
        offset = self._size
        try:
            written = 0
            while written < len(view):
                written += os.write(self._fd, view[written:])
            if self.sync:
                os.fdatasync(self._fd)
        except OSError as exc:
            raise StorageError(f"cannot write to {self._path(self._active)}: {exc}") from exc
        self._size += len(view)
        return self._active, offset, len(view)

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

    def committed(self, added: Iterable[int], released: Iterable[int], *, cleared: bool = False) -> None:
        """After a commit: count the new items per segment, drop released ones, delete dead segments.

        ``cleared``: the transaction removed every earlier item (after :meth:`clear`), so every segment before the
        active one that holds no new item is dead.
        """
        if cleared:
            self.live.clear()
        self.live.update(added)
        self.live.subtract(released)
        for segment in [s for s, n in self.live.items() if n <= 0]:
            del self.live[segment]
            if segment != self._active:
                self._delete(segment)
        if cleared:
            for path in self.directory.glob(f"*{_SUFFIX}"):
                segment = int(path.stem) if path.stem.isdigit() else -1
                if segment < self._active and segment not in self.live:
                    self._delete(segment)

    def clear(self) -> None:
        """Start a new active segment, so a clearing transaction's own items never share one with the dead."""
        self._roll(self._active + 1)

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
