"""The embedded default backend: one SQLite file in WAL mode.

Items are rows whose payload is the group's compact binary encoding (:func:`rollhub.wire.codec.pack_group`:
int32 tokens and masks, float32 log-probs), never JSON lists. Payloads of ``blob_bytes`` or more are appended to
segment files beside the database (:mod:`rollhub.buffer.blobs`) and the row says where they are. Small state
(registration, environments, step, leases, counters) lives in a key/value table as JSON. Every
:class:`Transaction` is one SQLite transaction.

Checkpoints (copying the WAL back into the database file, with its fsyncs) run in a background thread on a
connection of their own, not inside the commit of whichever write crossed SQLite's automatic threshold: measured
on 400 KB groups, that took about 0.5 ms per group off the ingest path. Under writes that never pause, a
checkpoint running beside them never catches up with the end of the WAL, so SQLite could never start the WAL over
and it would grow without end. So each checkpoint has two passes: the bulk beside the writes, then, holding writes
off, the few frames written meanwhile, after which the WAL starts over. The WAL stays near ``checkpoint_bytes``
plus what arrives during one checkpoint.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rollhub.buffer.blobs import BlobLog
from rollhub.buffer.storage import Entry, Storage, StoredItem, StoredState, Transaction
from rollhub.errors import ConfigError, RollhubError, StorageError
from rollhub.wire.codec import pack_group, unpack_stored_group

log = logging.getLogger("rollhub.storage")
_COLUMNS = "gid, ord, state, lease_id, env_id, size, policy_version, n_tokens, payload, blob_seg, blob_off, blob_len"
_SCHEMA = """
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
    blob_len INTEGER
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class SqliteStorage(Storage):
    """Durable storage in one SQLite database (WAL; ``synchronous=NORMAL`` unless asked for ``FULL``).

    With ``NORMAL`` a committed transaction survives any crash of the server process (SIGKILL, OOM);
    ``FULL`` also survives power loss at the cost of an fsync per commit (and per blob append). After a power loss
    under ``NORMAL`` the last transactions may be lost, as SQLite documents; a row whose blob did not reach the
    disk is one of them and is dropped (with a warning) when the file is opened.

    Args:
        path: the database file; blob segments go in ``<path>.blobs/``.
        synchronous: SQLite's ``synchronous`` setting.
        encode, decode: payload codec (default: the group codec).
        checkpoint_bytes: WAL bytes between background checkpoints.
        blob_bytes: payloads at least this large go to the segment files (``None``: all stay in SQLite).
        segment_bytes: size at which the active segment file rolls over.
    """

    durable = True

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: str = "NORMAL",
        encode: Callable[[Any], bytes] = pack_group,
        decode: Callable[[bytes], Any] = unpack_stored_group,
        checkpoint_bytes: int = 64 * 2**20,
        blob_bytes: int | None = 64 * 1024,
        segment_bytes: int = 256 * 2**20,
    ) -> None:
        if checkpoint_bytes < 1:
            raise ConfigError(f"checkpoint_bytes must be positive, got {checkpoint_bytes}")
        if (blob_bytes is not None and blob_bytes < 1) or segment_bytes < 1:
            raise ConfigError(f"blob_bytes and segment_bytes must be positive, got {blob_bytes}, {segment_bytes}")
        self.path = Path(path)
        self.url = f"sqlite:///{self.path}"
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ConfigError(f"synchronous={synchronous!r}; use normal or full")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._encode, self._decode = encode, decode
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            # Groups are blobs of hundreds of KB: 64 KiB pages write them with a fraction of the page overhead
            # (measured 3.6 -> 1.4 ms per 400 KB insert). Takes effect when the file is created.
            self._db.execute("PRAGMA page_size=65536")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
            self._db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread does it
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(items)")}
            for column in ("blob_seg", "blob_off", "blob_len"):  # files written before blobs had segments
                if column not in columns:
                    self._db.execute(f"ALTER TABLE items ADD COLUMN {column} INTEGER")
            self._ckpt_db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._ckpt_db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        except sqlite3.DatabaseError as exc:
            raise StorageError(f"cannot open sqlite database {self.path}: {exc}") from exc
        self.checkpoint_bytes = checkpoint_bytes
        self.checkpoints = 0  # completed background checkpoints
        self._page_size = int(self._db.execute("PRAGMA page_size").fetchone()[0])
        self._db.execute(f"PRAGMA journal_size_limit={checkpoint_bytes}")
        self._written = 0  # payload bytes committed since the last checkpoint was asked for
        self._ckpt_wanted = threading.Event()
        self._closing = False
        self._blob_bytes = blob_bytes
        self._blobs = BlobLog(Path(f"{self.path}.blobs"), segment_bytes, sync=synchronous.upper() in ("FULL", "EXTRA"))
        self._seg_of: dict[int, int] = {}  # gid -> segment, for items whose payload is in a segment
        self._open_blobs()
        self._ckpt_thread = threading.Thread(target=self._checkpointer, name="rollhub-sqlite-checkpoint", daemon=True)
        self._ckpt_thread.start()

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
                self._seg_of[gid] = seg
        if lost:
            log.warning("%s: %d item(s) whose data never reached the disk are dropped", self.path, len(lost))
            self._db.executemany("DELETE FROM items WHERE gid = ?", [(g,) for g in lost])
        try:
            self._blobs.open(Counter(self._seg_of.values()))
        except OSError as exc:
            raise StorageError(f"cannot open the blob segments of {self.path}: {exc}") from exc

    @classmethod
    def from_url(cls, url: str) -> SqliteStorage:
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
        return cls(path, synchronous=query.get("synchronous", ["NORMAL"])[0])

    def load(self) -> StoredState:
        with self._lock:
            rows = self._db.execute(
                "SELECT gid, size, env_id, policy_version, n_tokens, state, ord, lease_id FROM items ORDER BY ord"
            ).fetchall()
            meta = {k: json.loads(v) for k, v in self._db.execute("SELECT key, value FROM meta")}
        items = [StoredItem(Entry(g, s, e, v, n), st, o, lid) for g, s, e, v, n, st, o, lid in rows]
        return StoredState(items=items, meta=meta)

    def apply(self, tx: Transaction) -> None:
        if not tx:
            return
        encoded = [(e, order, state, self._encode_one(payload)) for e, payload, state, order in tx.puts]
        with self._lock:
            db = self._db
            if tx.clear:
                self._blobs.clear()
            puts = []
            for e, order, state, blob in encoded:  # blobs first: a row never commits before its bytes are written
                where: tuple[int | None, int | None, int | None] = (None, None, None)
                if self._blob_bytes is not None and len(blob) >= self._blob_bytes:
                    where, blob = self._blobs.append(blob), b""
                puts.append((e.gid, order, state, None, e.env_id, e.size, e.policy_version, e.n_tokens, blob, *where))
            try:
                db.execute("BEGIN IMMEDIATE")
                if tx.clear:
                    db.execute("DELETE FROM items")
                    db.execute("DELETE FROM meta")
                if puts:
                    db.executemany(f"INSERT INTO items ({_COLUMNS}) VALUES ({', '.join('?' * 12)})", puts)
                if tx.deletes:
                    db.executemany("DELETE FROM items WHERE gid = ?", [(g,) for g in tx.deletes])
                for gids, state, lease_id, order in tx.moves:
                    if order is None:
                        db.executemany(
                            "UPDATE items SET state = ?, lease_id = ? WHERE gid = ?",
                            [(state, lease_id, g) for g in gids],
                        )
                    else:
                        db.executemany(
                            "UPDATE items SET state = ?, lease_id = ?, ord = ? WHERE gid = ?",
                            [(state, lease_id, order + k * 1e-6, g) for k, g in enumerate(gids)],
                        )
                if tx.meta:
                    db.executemany(
                        "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                        [(k, json.dumps(v)) for k, v in tx.meta.items()],
                    )
                db.execute("COMMIT")
            except BaseException as exc:
                # any failure (a value sqlite cannot bind, too) must not leave the transaction open
                if db.in_transaction:
                    db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.DatabaseError):
                    raise StorageError(f"sqlite write to {self.path} failed: {exc}") from exc
                raise
            self._blobs_committed(tx, puts)
            self._after_commit(sum(len(p[8]) for p in puts) + self._page_size * (len(tx.moves) + len(puts) + 1))

    def _blobs_committed(self, tx: Transaction, puts: list[tuple[Any, ...]]) -> None:
        if tx.clear:
            self._seg_of.clear()
        released = [self._seg_of.pop(g) for g in tx.deletes if g in self._seg_of]
        added = {p[0]: p[9] for p in puts if p[9] is not None}
        self._seg_of.update(added)
        self._blobs.committed(added.values(), released, cleared=tx.clear)

    def _after_commit(self, nbytes: int) -> None:
        """Ask for a background checkpoint every ``checkpoint_bytes`` written."""
        self._written += nbytes
        if self._written >= self.checkpoint_bytes:
            self._written = 0
            self._ckpt_wanted.set()

    def _encode_one(self, payload: Any) -> bytes | memoryview:
        wire = getattr(payload, "wire", None)
        if wire is not None and self._encode is pack_group:
            return wire  # the client's own encoding, known to decode to this very group
        try:
            return self._encode(payload)
        except (AttributeError, TypeError) as exc:
            raise ConfigError(
                f"sqlite storage holds scored groups, not {type(payload).__name__} ({exc}); "
                "use the memory backend for other payloads, or give SqliteStorage an encode/decode pair"
            ) from None

    def raw_payloads(self, gids: Sequence[int]) -> list[bytes]:
        """The stored encodings of ``gids`` in that order (what a binary batch sends as-is)."""
        if not gids:
            return []
        with self._lock:
            found: dict[int, bytes] = {}
            for start in range(0, len(gids), 500):
                chunk = list(gids[start : start + 500])
                marks = ",".join("?" * len(chunk))
                query = f"SELECT gid, payload, blob_seg, blob_off, blob_len FROM items WHERE gid IN ({marks})"
                for gid, payload, seg, off, length in self._db.execute(query, chunk):
                    found[gid] = payload if seg is None else self._blobs.read(seg, off, length)
        try:
            return [found[g] for g in gids]
        except KeyError as exc:
            raise StorageError(f"item {exc.args[0]} is missing from {self.path}") from None

    def payloads(self, gids: Sequence[int]) -> list[Any]:
        out = []
        for gid, blob in zip(gids, self.raw_payloads(gids), strict=True):
            try:
                out.append(self._decode(blob))
            except (RollhubError, KeyError, TypeError, ValueError) as exc:
                raise StorageError(
                    f"item {gid} in {self.path} cannot be decoded ({exc}); the file is damaged"
                ) from None
        return out

    def _checkpointer(self) -> None:
        """Run a PASSIVE checkpoint whenever ``checkpoint_bytes`` have been written since the last one."""
        while True:
            self._ckpt_wanted.wait()
            if self._closing:
                return
            self._ckpt_wanted.clear()
            try:
                self._ckpt_db.execute("PRAGMA wal_checkpoint(PASSIVE)")  # the bulk, beside the writes
                with self._lock:  # the frames written meanwhile, with writes held off: the WAL can start over
                    self._ckpt_db.execute("PRAGMA wal_checkpoint(RESTART)")
                self.checkpoints += 1
            except sqlite3.Error as exc:  # retried on the next signal; the WAL keeps the data meanwhile
                log.warning("%s: background checkpoint failed (%s); the WAL holds the data", self.path, exc)

    def close(self) -> None:
        self._closing = True
        self._ckpt_wanted.set()
        self._ckpt_thread.join(timeout=30)
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass  # the WAL stays; SQLite replays it on the next open
            self._ckpt_db.close()
            self._db.close()
            self._blobs.close()
