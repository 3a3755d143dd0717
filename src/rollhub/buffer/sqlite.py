"""The embedded default backend: one SQLite file in WAL mode.

Items are rows whose payload is written by the :class:`~rollhub.buffer.storage.Codec` its builder gives it (for
scored groups the server gives the compact binary encoding of :func:`rollhub.wire.codec.pack_group`: int32 tokens
and masks, float32 log-probs, never JSON lists). Payloads of ``blob_bytes`` or more are appended to
segment files beside the database (:mod:`rollhub.buffer.blobs`) and the row says where they are. Every row keeps
the CRC-32 of its payload, checked on every read: an item that fails it (or cannot be decoded) is quarantined,
counted in :meth:`SqliteStorage.stats`, and never served, instead of blocking the queue. Small state
(registration, environments, step, leases, counters) lives in a key/value table as JSON. Every
:class:`Transaction` is one SQLite transaction. Checkpoints: :mod:`rollhub.buffer.checkpoints`.

``items`` holds one row per stored item: its queue metadata, its payload (or where in a segment file it is) and the
CRC-32 of the payload. ``meta`` is a key/value table of JSON. ``quarantine`` records items found damaged.

A full disk refuses new data (:class:`~rollhub.errors.StorageFull`) and corrupts nothing: a failed blob write is
cut back and its transaction rolled back. Serving and acknowledging go on: the first failure releases a reserve
file (:mod:`rollhub.buffer.space`) so their small transactions have room, and while the disk is full each commit is
checkpointed at once so the next one reuses the WAL's space. Consumed blobs give their blocks back; once the disk
has room again, the reserve is taken back and new data is accepted, with no call needed.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rollhub.buffer.blobs import BlobLog, Location
from rollhub.buffer.checkpoints import Checkpointer
from rollhub.buffer.space import SpaceReserve, is_disk_full
from rollhub.buffer.storage import Codec, Entry, Storage, StoredItem, StoredState, Transaction
from rollhub.errors import ConfigError, ItemsDamaged, RollhubError, StorageError, StorageFull

log = logging.getLogger("rollhub.storage")

# ------------------------------------------------------------------------------------------ tables

COLUMNS = (
    "gid, ord, state, lease_id, env_id, size, policy_version, n_tokens, payload, blob_seg, blob_off, blob_len, crc"
)
SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    gid INTEGER PRIMARY KEY,
    ord REAL NOT NULL,
    state TEXT NOT NULL,
    lease_id TEXT,
    env_id INTEGER,
    size INTEGER NOT NULL,
    policy_version INTEGER,
    n_tokens INTEGER NOT NULL,
    payload BLOB NOT NULL,
    blob_seg INTEGER,
    blob_off INTEGER,
    blob_len INTEGER,
    crc INTEGER
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS quarantine (
    gid INTEGER PRIMARY KEY, reason TEXT NOT NULL, at REAL NOT NULL,
    blob_seg INTEGER, blob_off INTEGER, blob_len INTEGER
);
"""
ADDED_COLUMNS = ("blob_seg", "blob_off", "blob_len", "crc")  # absent from files written by earlier versions


def _connect(path: Path, sync: str, journal_size_limit: int) -> sqlite3.Connection:
    """Open (creating if needed) the database in WAL mode with rollhub's tables, upgrading older files in place."""
    try:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        # Groups are blobs of hundreds of KB: 64 KiB pages write them with a fraction of the page overhead
        # (measured 3.6 -> 1.4 ms per 400 KB insert). Takes effect when the file is created.
        db.execute("PRAGMA page_size=65536")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={sync}")
        db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer does it
        db.execute(f"PRAGMA journal_size_limit={journal_size_limit}")
        db.executescript(SCHEMA)
        columns = {row[1] for row in db.execute("PRAGMA table_info(items)")}
        for column in ADDED_COLUMNS:
            if column not in columns:
                db.execute(f"ALTER TABLE items ADD COLUMN {column} INTEGER")
    except sqlite3.DatabaseError as exc:
        raise StorageError(f"cannot open sqlite database {path}: {exc}") from exc
    return db


def _write(db: sqlite3.Connection, tx: Transaction, puts: list[tuple[Any, ...]]) -> None:
    """Apply ``tx`` (its new items as ready ``puts`` rows) in one SQLite transaction, rolled back on any failure."""
    try:
        db.execute("BEGIN IMMEDIATE")
        if tx.clear:
            db.execute("DELETE FROM items")
            db.execute("DELETE FROM meta")
        if puts:
            db.executemany(f"INSERT INTO items ({COLUMNS}) VALUES ({', '.join('?' * 13)})", puts)
        if tx.deletes:
            db.executemany("DELETE FROM items WHERE gid = ?", [(g,) for g in tx.deletes])
        for gids, state, lease_id, order in tx.moves:
            if order is None:
                rows = [(state, lease_id, g) for g in gids]
                db.executemany("UPDATE items SET state = ?, lease_id = ? WHERE gid = ?", rows)
            else:
                rows = [(state, lease_id, order + k * 1e-6, g) for k, g in enumerate(gids)]
                db.executemany("UPDATE items SET state = ?, lease_id = ?, ord = ? WHERE gid = ?", rows)
        if tx.meta:
            db.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in tx.meta.items()]
            )
        db.execute("COMMIT")
    except BaseException:
        # any failure (a value sqlite cannot bind, too) must not leave the transaction open
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _record_rows(db: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
    """Move items to ``quarantine``: ``rows`` are (gid, reason, time, segment, offset, length)."""
    try:
        db.execute("BEGIN IMMEDIATE")
        db.executemany("INSERT OR REPLACE INTO quarantine VALUES (?, ?, ?, ?, ?, ?)", rows)
        db.executemany("DELETE FROM items WHERE gid = ?", [(row[0],) for row in rows])
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


# ---------------------------------------------------------------------------------------- settings


def sqlite_url(url: str) -> tuple[str, str]:
    """``sqlite:///rel.db`` or ``sqlite:////abs.db`` (``?synchronous=full`` optional) -> (path, synchronous)."""
    parts = urlsplit(url)
    path = parts.path
    if path.startswith("/") and not path.startswith("//"):
        path = path[1:]  # sqlite:///rel.db -> rel.db ; sqlite:////abs.db -> /abs.db
    elif path.startswith("//"):
        path = path[1:]
    if parts.netloc:
        path = parts.netloc + ("/" + path if path else "")
    if not path:
        raise ConfigError(f"storage URL {url!r} names no file; use sqlite:///rollhub.db")
    query = parse_qs(parts.query)
    return path, query.get("synchronous", ["NORMAL"])[0]


def checked_settings(synchronous: str, checkpoint_bytes: int, blob_bytes: int | None, segment_bytes: int,
                     reserve_bytes: int, idle_s: float) -> str:  # fmt: skip
    """Refuse settings that cannot work, naming the field; return the SQLite ``synchronous`` level."""
    if checkpoint_bytes < 1:
        raise ConfigError(f"checkpoint_bytes must be positive, got {checkpoint_bytes}", field="checkpoint_bytes")
    if (blob_bytes is not None and blob_bytes < 1) or segment_bytes < 1:
        raise ConfigError(
            f"blob_bytes and segment_bytes must be positive, got {blob_bytes}, {segment_bytes}", field="blob_bytes"
        )
    if reserve_bytes < 0 or not idle_s > 0:
        raise ConfigError(f"reserve_bytes must be >= 0 and idle_s > 0, got {reserve_bytes}, {idle_s}", field="idle_s")
    sync = synchronous.upper()
    if sync not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        raise ConfigError(f"synchronous={synchronous!r}; use normal or full", field="synchronous")
    return sync


# ----------------------------------------------------------------------------------------- backend


class SqliteStorage(Storage):
    """Durable storage in one SQLite database (WAL; ``synchronous=NORMAL`` unless asked for ``FULL``).

    With ``NORMAL`` a committed transaction survives any crash of the server process (SIGKILL, OOM);
    ``FULL`` also survives power loss at the cost of an fsync per commit (and per blob append). After a power loss
    under ``NORMAL`` the last transactions may be lost, as SQLite documents; a row whose blob did not reach the
    disk is one of them and is dropped (with a warning) when the file is opened.

    Args:
        path: the database file; blob segments go in ``<path>.blobs/``, the space reserve is ``<path>.reserve``.
        synchronous: SQLite's ``synchronous`` setting.
        codec: how payloads are written as bytes and read back.
        checkpoint_bytes: WAL bytes between background checkpoints; past four times this the writer checkpoints.
        blob_bytes: payloads at least this large go to the segment files (``None``: all stay in SQLite).
        segment_bytes: size at which the active segment file rolls over.
        reserve_bytes: disk space held back for serving and acknowledging once the disk is full (0: none).
        idle_s: seconds without a write after which the WAL is checkpointed and truncated.
        clock: monotonic seconds, for the idle checkpoint.
    """

    durable = True

    def __init__(
        self,
        path: str | Path,
        *,
        codec: Codec,
        synchronous: str = "NORMAL",
        checkpoint_bytes: int = 64 * 2**20,
        blob_bytes: int | None = 64 * 1024,
        segment_bytes: int = 256 * 2**20,
        reserve_bytes: int = 8 * 2**20,
        idle_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        sync = checked_settings(synchronous, checkpoint_bytes, blob_bytes, segment_bytes, reserve_bytes, idle_s)
        self.path = Path(path)
        self.url = f"sqlite:///{self.path}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._codec = codec
        self._lock = threading.Lock()
        self._db = _connect(self.path, sync, checkpoint_bytes)
        self._page_size = int(self._db.execute("PRAGMA page_size").fetchone()[0])
        self._blob_bytes = blob_bytes
        self._blobs = BlobLog(Path(f"{self.path}.blobs"), segment_bytes, sync=sync in ("FULL", "EXTRA"))
        self._loc: dict[int, Location] = {}  # gid -> where its payload is, for items stored in a segment
        self._quarantined = self._db.execute("SELECT count(*) FROM quarantine").fetchone()[0]
        self._unrecorded: dict[int, str] = {}  # quarantined, not yet written down (the disk was full)
        self.full = False  # the disk filled up; new data is refused until it has room again
        self.refused_full = 0  # transactions refused for want of space
        self._reserve = SpaceReserve(Path(f"{self.path}.reserve"), reserve_bytes)
        self._open_blobs()
        self._checkpointer = Checkpointer(
            self.path,
            self._lock,
            synchronous=sync,
            checkpoint_bytes=checkpoint_bytes,
            wal_limit=4 * checkpoint_bytes,
            idle_s=idle_s,
            clock=clock,
        )
        if not self._reserve.hold():
            with self._lock:
                self._enter_full()

    def _open_blobs(self) -> None:
        """Find every row's segment, drop rows whose blob is not (wholly) on disk, and open the blob log."""
        rows = self._db.execute(
            "SELECT gid, blob_seg, blob_off, blob_len FROM items WHERE blob_seg IS NOT NULL"
        ).fetchall()
        sizes: dict[int, int] = {}
        lost = []
        for gid, seg, off, length in rows:
            if seg not in sizes:
                sizes[seg] = self._blobs.size_of(seg)
            if off + length > sizes[seg]:
                lost.append(gid)
            else:
                self._loc[gid] = (seg, off, length)
        if lost:
            log.warning("%s: %d item(s) whose data never reached the disk are dropped", self.path, len(lost))
            self._db.executemany("DELETE FROM items WHERE gid = ?", [(g,) for g in lost])
        try:
            self._blobs.open(Counter(seg for seg, _, _ in self._loc.values()))
        except OSError as exc:
            raise StorageError(f"cannot open the blob segments of {self.path}: {exc}") from exc

    @property
    def reserve(self) -> SpaceReserve:
        """The disk space held back for serving once the disk is full."""
        return self._reserve

    @property
    def blobs(self) -> BlobLog:
        """The segment files of large payloads."""
        return self._blobs

    @property
    def checkpointer(self) -> Checkpointer:
        """What keeps the WAL bounded (and small when idle)."""
        return self._checkpointer

    @property
    def checkpoints(self) -> int:
        """Completed WAL checkpoints since the file was opened."""
        return self._checkpointer.checkpoints

    def stats(self) -> dict[str, Any]:
        """Health figures: items quarantined, whether the disk is full, and transactions refused for want of space."""
        with self._lock:
            if self.full:
                self._try_resume()
            return {
                "quarantined": self._quarantined + len(self._unrecorded),
                "disk_full": self.full,
                "refused_full": self.refused_full,
            }

    @classmethod
    def from_url(cls, url: str, codec: Codec) -> SqliteStorage:
        """The storage ``sqlite:///path.db[?synchronous=full]`` names, writing payloads with ``codec``."""
        path, synchronous = sqlite_url(url)
        return cls(path, codec=codec, synchronous=synchronous)

    def load(self) -> StoredState:
        with self._lock:
            rows = self._db.execute(
                "SELECT gid, size, env_id, policy_version, n_tokens, state, ord, lease_id FROM items ORDER BY ord"
            ).fetchall()
            meta = {k: json.loads(v) for k, v in self._db.execute("SELECT key, value FROM meta")}
        items = [StoredItem(Entry(g, s, e, v, n), st, o, lid) for g, s, e, v, n, st, o, lid in rows]
        return StoredState(items=items, meta=meta)

    def apply(self, tx: Transaction) -> None:
        """Commit ``tx`` whole or not at all.

        Raises:
            StorageFull: the disk is full; a transaction with new items is refused (nothing of it stored), one that
                only serves, acknowledges or deletes is refused only if even the released reserve cannot hold it.
            StorageError: any other failure of the database or the segment files (nothing of ``tx`` stored).
        """
        if not tx:
            return
        encoded = [(e, order, state, self._encode_one(payload)) for e, payload, state, order in tx.puts]
        crcs = [zlib.crc32(blob) for _, _, _, blob in encoded]
        with self._lock:
            if self.full and not self._try_resume() and tx.puts:
                self.refused_full += 1
                raise self._full_error()
            self._record_quarantine()
            mark = self._blobs.mark()
            try:
                if tx.clear:
                    self._blobs.clear()
                puts = [self._row(*put, crc) for put, crc in zip(encoded, crcs, strict=True)]
                self._commit_retrying(tx, puts)
            except BaseException as exc:
                self._blobs.rollback(mark)
                if isinstance(exc, StorageFull) or is_disk_full(exc):
                    self._enter_full()
                    self.refused_full += 1
                    raise self._full_error(serving=not tx.puts) from exc
                raise
            self._blobs_committed(tx, puts)
            nbytes = sum(len(p[8]) for p in puts) + self._page_size * (len(tx.moves) + len(puts) + 1)
            self._checkpointer.committed(nbytes, in_place=self.full or self._reserve.low())
            if self._checkpointer.failed_full:  # the next transactions would only make the WAL longer
                self._enter_full()

    def _row(self, e: Entry, order: float, state: str, blob: bytes | memoryview, crc: int) -> tuple[Any, ...]:
        """The row of one new item; a large payload is written to a segment first (a row never precedes its bytes)."""
        where: tuple[int | None, int | None, int | None] = (None, None, None)
        if self._blob_bytes is not None and len(blob) >= self._blob_bytes:
            where, blob = self._blobs.append(blob), b""
        return (e.gid, order, state, None, e.env_id, e.size, e.policy_version, e.n_tokens, blob, *where, crc)

    def _commit_retrying(self, tx: Transaction, puts: list[tuple[Any, ...]]) -> None:
        """Commit; a serving transaction that meets a full disk is retried once with the reserve released."""
        try:
            self._commit(tx, puts)
        except StorageError as exc:
            if not is_disk_full(exc):
                raise
            self._enter_full()
            if puts:
                raise
            self._commit(tx, puts)

    def _commit(self, tx: Transaction, puts: list[tuple[Any, ...]]) -> None:
        try:
            _write(self._db, tx, puts)
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"sqlite write to {self.path} failed: {exc}") from exc

    def _enter_full(self) -> None:
        """The disk is full (write lock held): give the reserve back and keep the WAL in the space it has."""
        if not self.full:
            log.warning("%s: the disk is full; new data is refused until space returns, serving goes on", self.path)
        self.full = True
        self._checkpointer.failed_full = False
        self._reserve.release()
        self._checkpointer.idle_mode = "RESTART"
        self._checkpointer.checkpoint("RESTART")

    def _try_resume(self) -> bool:
        """Leave the full state if the disk has room again for the reserve and new data (write lock held)."""
        if not (self._reserve.room_to_resume() and self._reserve.hold()):
            return False
        log.warning("%s: the disk has room again; new data is accepted", self.path)
        self.full = False
        self._checkpointer.idle_mode = "TRUNCATE"
        return True

    def _full_error(self, serving: bool = False) -> StorageFull:
        if serving:
            return StorageFull(
                f"the disk holding {self.path} is full and even its released reserve cannot record this change "
                "(nothing of it was stored, nothing was served); free disk space, or give the storage a larger "
                "reserve_bytes"
            )
        return StorageFull(
            f"the disk holding {self.path} is full, so new data is refused and nothing of this request was stored; "
            "serving and acknowledging go on, consumed data frees space, and new data is accepted again by itself "
            "once there is room: retry later, or free disk space"
        )

    def _blobs_committed(self, tx: Transaction, puts: list[tuple[Any, ...]]) -> None:
        if tx.clear:
            self._loc.clear()
        released = [self._loc.pop(g) for g in tx.deletes if g in self._loc]
        added = {p[0]: (p[9], p[10], p[11]) for p in puts if p[9] is not None}
        self._loc.update(added)
        self._blobs.committed((seg for seg, _, _ in added.values()), released, cleared=tx.clear)

    def _encode_one(self, payload: Any) -> bytes | memoryview:
        codec = self._codec
        if codec.reuses_wire:
            wire = getattr(payload, "wire", None)
            if wire is not None:
                return wire  # the client's own encoding, known to decode to this very payload
        try:
            return codec.encode(payload)
        except (AttributeError, TypeError) as exc:
            raise ConfigError(
                f"this sqlite storage holds {codec.holds}, not {type(payload).__name__} ({exc}); "
                "use the memory backend for other payloads, or give SqliteStorage a codec for them"
            ) from None

    def raw_payloads(self, gids: Sequence[int]) -> list[bytes]:
        """The stored encodings of ``gids`` in that order (what a binary batch sends as-is), each checked.

        Raises:
            ItemsDamaged: some failed their checksum or are not (wholly) in their segment; they are quarantined.
        """
        blobs, damaged = self._read(gids)
        if damaged:
            self._quarantine(damaged)
        return blobs

    def payloads(self, gids: Sequence[int]) -> list[Any]:
        """The decoded payloads of ``gids`` in that order.

        Raises:
            ItemsDamaged: some failed their checksum or cannot be decoded; they are quarantined, so the caller
                can drop them and carry on.
        """
        blobs, damaged = self._read(gids)
        out = []
        for gid, blob in zip(gids, blobs, strict=True):
            if gid in damaged:
                continue
            try:
                out.append(self._codec.decode(blob))
            except (RollhubError, KeyError, TypeError, ValueError) as exc:
                damaged[gid] = f"cannot be decoded ({exc})"
        if damaged:
            self._quarantine(damaged)
        return out

    def _read(self, gids: Sequence[int]) -> tuple[list[bytes], dict[int, str]]:
        """Every payload's bytes, checked against its CRC; the damaged ones (gid -> why) get ``b""``."""
        found: dict[int, bytes] = {}
        damaged: dict[int, str] = {}
        with self._lock:
            for start in range(0, len(gids), 500):
                chunk = list(gids[start : start + 500])
                marks = ",".join("?" * len(chunk))
                query = f"SELECT gid, payload, blob_seg, blob_off, blob_len, crc FROM items WHERE gid IN ({marks})"
                for gid, payload, seg, off, length, crc in self._db.execute(query, chunk):
                    try:
                        data = payload if seg is None else self._blobs.read(seg, off, length)
                    except (StorageError, OSError) as exc:
                        damaged[gid], data = str(exc), b""
                    if crc is not None and gid not in damaged and zlib.crc32(data) != crc:
                        damaged[gid] = f"checksum mismatch (stored {crc:#010x}, read {zlib.crc32(data):#010x})"
                    found[gid] = data
        missing = [g for g in gids if g not in found]
        if missing:
            raise StorageError(f"item(s) {missing[:10]} are missing from {self.path}")
        return [found[g] for g in gids], damaged

    def _quarantine(self, damaged: dict[int, str]) -> None:
        """Take damaged items out of the queue for good, record why, and raise :class:`ItemsDamaged`."""
        with self._lock:
            self._unrecorded.update(damaged)
            self._record_quarantine()
        gids = sorted(damaged)
        reasons = "; ".join(f"item {g}: {damaged[g]}" for g in gids[:5])
        log.error("%s: %d damaged item(s) quarantined (%s)", self.path, len(gids), reasons)
        raise ItemsDamaged(
            f"{len(gids)} stored item(s) in {self.path} are damaged and were quarantined, never to be served "
            f"({reasons}); the rest of the queue is served as usual. Check the disk",
            gids=gids,
        )

    def _record_quarantine(self) -> None:
        """Write down quarantined items not yet recorded (write lock held); on a full disk, try again later."""
        if not self._unrecorded:
            return
        now = time.time()
        rows = [(g, why, now, *self._loc.get(g, (None, None, None))) for g, why in self._unrecorded.items()]
        try:
            _record_rows(self._db, rows)
        except sqlite3.Error as exc:
            log.warning("%s: cannot record quarantined items yet (%s); they stay out of the queue", self.path, exc)
            return
        # their blobs stay (for inspection) until their segment is deleted after a restart
        for gid in self._unrecorded:
            self._loc.pop(gid, None)
        self._quarantined += len(self._unrecorded)
        self._unrecorded.clear()

    def close(self) -> None:
        self._checkpointer.close()
        with self._lock:
            self._db.close()
            self._blobs.close()
