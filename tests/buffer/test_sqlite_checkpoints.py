"""SQLite checkpoints run in the background and keep the WAL bounded under writes that never pause."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from buffer_support import heavy_group, registration

from rollhub.buffer import BufferConfig, ExperienceBuffer
from rollhub.buffer.sqlite import SqliteStorage
from rollhub.errors import ConfigError


def wal_size(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_the_wal_stays_bounded_and_every_group_survives(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    limit = 1 << 20
    storage = SqliteStorage(path, checkpoint_bytes=limit, blob_bytes=None)  # payloads in the WAL
    buffer = ExperienceBuffer(storage, BufferConfig())
    buffer.register_trainer(registration(batch_size=4))
    largest = 0
    for tag in range(160):  # about 20 MB, written back to back
        buffer.ingest([heavy_group(tag)])
        largest = max(largest, wal_size(path))
    deadline = time.monotonic() + 10
    while storage.checkpoints == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert storage.checkpoints >= 1
    # without the second, write-holding pass the WAL would hold all ~20 MB here
    assert largest < 8 * limit, f"WAL reached {largest} bytes"
    storage.close()
    assert wal_size(path) == 0, "close() checkpoints and truncates the WAL"
    reopened = ExperienceBuffer(SqliteStorage(path), BufferConfig())
    served = []
    while (batch := reopened.next_batch()) is not None:
        served += [int(g.tokens.data[0]) for g in batch.items]
    assert served == list(range(160))
    reopened.storage.close()


def test_checkpoint_bytes_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="checkpoint_bytes"):
        SqliteStorage(tmp_path / "x.db", checkpoint_bytes=0)
    assert not os.path.exists(tmp_path / "x.db")
