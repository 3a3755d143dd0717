"""Every stored item is checked when read back; a damaged one is quarantined and counted, never jamming the queue."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from buffer_support import drain, env_request, heavy_group, make_group, scored, served_tokens
from buffer_support import open_sqlite_buffer as open_buffer

from rollhub.buffer.sqlite import SqliteStorage
from rollhub.server import shapes
from rollhub.wire.codec import pack_group


def test_a_flipped_byte_in_a_segment_quarantines_that_item_only(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    buffer = open_buffer(path)
    for tag in range(5):
        buffer.ingest([heavy_group(tag)])
    (segment,) = Path(f"{path}.blobs").glob("*.seg")
    blob = len(pack_group(heavy_group(0)))
    with segment.open("r+b") as f:  # damage the second group's tokens; its encoding still parses
        f.seek(blob + blob // 2)
        byte = f.read(1)
        f.seek(blob + blob // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert drain(buffer) == [0, 2, 3, 4]
    assert buffer.status().storage["quarantined"] == 1
    buffer.storage.close()
    reopened = open_buffer(path)
    assert reopened.status().storage["quarantined"] == 1, "the count is kept in the database"
    assert drain(reopened) == []
    reason = reopened.storage._db.execute("SELECT reason FROM quarantine").fetchone()[0]  # type: ignore[attr-defined]
    assert "checksum mismatch" in reason
    reopened.storage.close()


def test_a_changed_payload_inside_sqlite_fails_its_checksum(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    buffer = open_buffer(path, blob_bytes=None)
    for tag in range(3):
        buffer.ingest([heavy_group(tag)])
    storage = buffer.storage
    assert isinstance(storage, SqliteStorage)
    gid = buffer.queued()[0].gid
    payload = bytearray(storage._db.execute("SELECT payload FROM items WHERE gid = ?", (gid,)).fetchone()[0])
    payload[-100] ^= 0x01
    storage._db.execute("UPDATE items SET payload = ? WHERE gid = ?", (bytes(payload), gid))
    assert drain(buffer) == [1, 2]
    assert buffer.status().storage["quarantined"] == 1
    storage.close()


def test_an_old_database_with_an_undecodable_row_no_longer_jams_the_queue(tmp_path: Path) -> None:
    path = tmp_path / "old.db"  # written before rows had checksums, with a row whose bytes are garbage
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE items (gid INTEGER PRIMARY KEY, ord REAL NOT NULL, state TEXT NOT NULL, lease_id TEXT,
            env_id INTEGER, size INTEGER NOT NULL, policy_version INTEGER, n_tokens INTEGER NOT NULL,
            payload BLOB NOT NULL, blob_seg INTEGER, blob_off INTEGER, blob_len INTEGER);
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        """
    )
    good = pack_group(heavy_group(7))
    rows = [(1, 1.0, b"\x93not a group"), (2, 2.0, good)]
    db.executemany("INSERT INTO items VALUES (?, ?, 'queued', NULL, NULL, 4, NULL, 16384, ?, NULL, NULL, NULL)", rows)
    db.commit()
    db.close()
    buffer = open_buffer(path)
    assert drain(buffer) == [7]
    assert buffer.status().storage["quarantined"] == 1
    buffer.storage.close()


def test_a_damaged_held_part_is_quarantined_and_the_rest_still_combines(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    buffer = open_buffer(path)
    buffer.mark_started()
    env_id = shapes.register_env(buffer.register_env(env_request(group_size=4)))["env_id"]
    buffer.ingest([make_group([1, 1], env_id=env_id)])
    storage = buffer.storage
    assert isinstance(storage, SqliteStorage)
    (gid, payload), *_ = storage._db.execute("SELECT gid, payload FROM items").fetchall()
    storage._db.execute("UPDATE items SET payload = ? WHERE gid = ?", (payload[:-1] + b"\x00", gid))
    assert scored(buffer.ingest([make_group([2, 2], env_id=env_id)])) == [{"status": "buffered", "buffer_size": 2}]
    assert buffer.status().storage["quarantined"] == 1
    assert scored(buffer.ingest([make_group([3, 3], env_id=env_id)])) == [{"status": "buffered", "buffer_size": 0}]
    batch = buffer.next_batch()
    assert batch is not None and sorted(served_tokens(batch)) == [2, 2, 3, 3]
    storage.close()
