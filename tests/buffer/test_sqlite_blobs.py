"""Large payloads live in segment files beside the SQLite index: written once, deleted when nothing points there."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
from buffer_support import drain, heavy_group, registration
from buffer_support import open_sqlite_buffer as open_buffer

from rollhub.buffer.sqlite import SqliteStorage
from rollhub.errors import StorageError
from rollhub.server.storage import GROUP_CODEC
from rollhub.wire.codec import pack_group


def segments(path: Path) -> list[str]:
    return sorted(p.name for p in Path(f"{path}.blobs").glob("*.seg"))


def test_large_payloads_go_to_segments_and_segments_die_with_their_items(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    buffer = open_buffer(path, segment_bytes=200_000)  # two groups per segment
    for tag in range(6):
        buffer.ingest([heavy_group(tag)])
    assert len(segments(path)) == 3
    assert path.stat().st_size < 1_000_000, "the database holds rows, not blobs"
    assert drain(buffer) == list(range(6))
    assert segments(path) == ["00000002.seg"], "served items free their segments; the active one stays"
    buffer.storage.close()


def test_segments_survive_a_reopen_and_a_reset_removes_them(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    buffer = open_buffer(path, segment_bytes=200_000)
    for tag in range(5):
        buffer.ingest([heavy_group(tag)])
    buffer.storage.close()
    reopened = open_buffer(path, segment_bytes=200_000)
    stored = reopened.storage.payloads([e.gid for e in reopened.queued()])
    assert [int(g.tokens.data[0]) for g in stored] == [0, 1, 2, 3, 4]
    reopened.ingest([heavy_group(5)])
    reopened.reset()
    reopened.register_trainer(registration(batch_size=4))
    reopened.ingest([heavy_group(9)])
    assert len(segments(path)) == 1
    assert drain(reopened) == [9]
    reopened.storage.close()
    again = open_buffer(path)
    assert drain(again) == []
    again.storage.close()


def test_a_blob_cut_short_by_a_power_loss_drops_only_its_row(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "b.db"
    buffer = open_buffer(path)
    for tag in range(3):
        buffer.ingest([heavy_group(tag)])
    buffer.storage.close()
    (segment,) = Path(f"{path}.blobs").glob("*.seg")
    size = segment.stat().st_size
    with segment.open("r+b") as f:  # the last blob never reached the disk
        f.truncate(size - 10)
    with caplog.at_level(logging.WARNING, logger="rollhub.storage"):
        reopened = open_buffer(path)
    assert "1 item(s) whose data never reached the disk" in caplog.text
    assert drain(reopened) == [0, 1]
    reopened.storage.close()


def test_a_database_from_before_segments_opens_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE items (gid INTEGER PRIMARY KEY, ord REAL NOT NULL, state TEXT NOT NULL, lease_id TEXT,
            env_id INTEGER, size INTEGER NOT NULL, policy_version INTEGER, n_tokens INTEGER NOT NULL,
            payload BLOB NOT NULL);
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        """
    )
    group = heavy_group(7)
    db.execute("INSERT INTO items VALUES (1, 1.0, 'queued', NULL, NULL, 4, NULL, ?, ?)", (16384, pack_group(group)))
    db.commit()
    db.close()
    buffer = open_buffer(path)
    buffer.ingest([heavy_group(8)])
    assert drain(buffer) == [7, 8]
    buffer.storage.close()


def test_an_unusable_blob_directory_is_a_storage_error(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    Path(f"{path}.blobs").write_text("a file where the segment directory belongs")
    with pytest.raises(StorageError, match="blob segments"):
        SqliteStorage(path, codec=GROUP_CODEC)
