"""WAL checkpoints of the SQLite backend: in the background, bounded by the writer, and small when idle.

Checkpoints (copying the WAL back into the database file, with its fsyncs) run in a background thread on a
connection of their own, not inside the commit of whichever write crossed a threshold: measured on 400 KB groups,
that took about 0.5 ms per group off the ingest path. Under writes that never pause, a checkpoint running beside
them never catches up with the end of the WAL, so SQLite could never start the WAL over. So each background
checkpoint has two passes: the bulk beside the writes, then, holding writes off, the few frames written meanwhile,
after which the WAL starts over.

A thread can be starved of CPU, so the bound does not rest on it: after each commit the writer looks at the WAL's
size and, past ``wal_limit`` bytes, runs the checkpoint itself before it returns. The WAL file therefore never
holds more than ``wal_limit`` bytes plus one transaction. When writes stop for ``idle_s`` seconds, the WAL is
checkpointed and truncated to nothing, so a quiet server keeps no large WAL beside its database.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rollhub.buffer.space import is_disk_full

log = logging.getLogger("rollhub.storage")


class Checkpointer:
    """Keeps one WAL-mode database's WAL bounded, whatever the thread scheduling.

    The writer calls :meth:`committed` after every commit, holding ``write_lock``. Lock order: ``write_lock``
    before the checkpointer's own lock, never the other way round.

    Args:
        path: the database file.
        write_lock: the lock every writer of the database holds.
        synchronous: SQLite's ``synchronous`` setting for the checkpoint connection.
        checkpoint_bytes: committed bytes between background checkpoints.
        wal_limit: WAL size past which the writer checkpoints synchronously.
        idle_s: seconds without a commit after which the WAL is truncated.
        clock: monotonic seconds (a test's clock can stand in).
    """

    def __init__(
        self,
        path: Path,
        write_lock: threading.Lock,
        *,
        synchronous: str,
        checkpoint_bytes: int,
        wal_limit: int,
        idle_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.wal_path = Path(f"{path}-wal")
        self.checkpoint_bytes = checkpoint_bytes
        self.wal_limit = wal_limit
        self.idle_s = idle_s
        self.idle_mode = "TRUNCATE"  # RESTART keeps the WAL's space (on a full disk it may not come back)
        self.checkpoints = 0  # completed checkpoints of any kind
        self.forced = 0  # of which the writer ran itself because the WAL passed wal_limit
        self.failed_full = False  # a checkpoint failed for want of disk space (the owner resets it)
        self._write_lock = write_lock
        self._lock = threading.Lock()  # one checkpoint at a time on the connection below
        self._clock = clock
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._written = 0
        self._dirty = False
        self._last_commit = clock()
        self._wanted = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="rollhub-sqlite-checkpoint", daemon=True)
        self._thread.start()

    def wal_bytes(self) -> int:
        """The WAL file's size now."""
        try:
            return self.wal_path.stat().st_size
        except FileNotFoundError:
            return 0

    def committed(self, nbytes: int, *, in_place: bool = False) -> None:
        """After a commit (``write_lock`` held): wake the background checkpoint, or run one if the WAL is too big.

        ``in_place``: checkpoint now so the next transaction reuses the WAL's existing space (a full disk).
        """
        self._dirty = True
        self._last_commit = self._clock()
        self._written += nbytes
        if in_place or self.wal_bytes() > self.wal_limit:
            if self.checkpoint("RESTART") and not in_place:
                self.forced += 1
            return
        if self._written >= self.checkpoint_bytes:
            self._written = 0
            self._wanted.set()

    def checkpoint(self, mode: str) -> bool:
        """Run a checkpoint of ``mode`` now (``write_lock`` held for RESTART and TRUNCATE); True when it completed."""
        with self._lock:
            try:
                busy = self._db.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()[0]
            except sqlite3.Error as exc:  # the WAL keeps the data meanwhile; retried on the next occasion
                log.warning("%s: checkpoint failed (%s); the WAL holds the data", self.wal_path, exc)
                self.failed_full = self.failed_full or is_disk_full(exc)
                return False
        if busy:
            return False
        self.checkpoints += 1
        if mode != "PASSIVE":
            self._written, self._dirty = 0, False
        return True

    def idle_checkpoint(self) -> bool:
        """If nothing was committed for ``idle_s`` seconds since the last checkpoint, truncate the WAL; True if done."""
        if not self._dirty or self._clock() - self._last_commit < self.idle_s:
            return False
        with self._write_lock:
            if not self._dirty or self._clock() - self._last_commit < self.idle_s:
                return False
            return self.checkpoint(self.idle_mode)

    def _run(self) -> None:
        while True:
            wanted = self._wanted.wait(timeout=self.idle_s)
            if self._closing:
                return
            if wanted:
                self._wanted.clear()
                self.checkpoint("PASSIVE")  # the bulk, beside the writes
                with self._write_lock:  # the frames written meanwhile, with writes held off: the WAL starts over
                    self.checkpoint("RESTART")
            else:
                self.idle_checkpoint()

    def close(self) -> None:
        """Stop the thread and truncate the WAL (``write_lock`` must not be held)."""
        self._closing = True
        self._wanted.set()
        self._thread.join(timeout=30)
        with self._write_lock:
            self.checkpoint("TRUNCATE")
            self._db.close()
