"""The WAL stays bounded whatever the thread scheduling, and small when writes stop."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from buffer_support import heavy_group, make_group, registration

from rollhub.buffer import BufferConfig, ExperienceBuffer
from rollhub.buffer.sqlite import SqliteStorage
from rollhub.errors import ConfigError
from rollhub.server.storage import GROUP_CODEC

ONE_TRANSACTION = 1 << 20  # one ~130 KB group in 64 KiB pages, with its index and header pages, is far below this


def wal_size(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return wal.stat().st_size if wal.exists() else 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fill(path: Path, storage: SqliteStorage, count: int) -> tuple[ExperienceBuffer, int]:
    """Ingest ``count`` heavy groups back to back; returns the buffer and the largest WAL seen after a commit."""
    buffer = ExperienceBuffer(storage, BufferConfig())
    buffer.register_trainer(registration(batch_size=4))
    largest = 0
    for tag in range(count):
        buffer.ingest([heavy_group(tag)])
        largest = max(largest, wal_size(path))
    return buffer, largest


def test_the_wal_stays_bounded_and_every_group_survives(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    storage = SqliteStorage(path, codec=GROUP_CODEC, checkpoint_bytes=1 << 20, blob_bytes=None)  # payloads in the WAL
    _, largest = fill(path, storage, 160)  # about 20 MB, written back to back
    # the bound holds by construction (the writer checkpoints past it), not by the background thread's pace
    assert largest <= storage.checkpointer.wal_limit + ONE_TRANSACTION, f"WAL reached {largest} bytes"
    assert storage.checkpoints >= 1
    storage.close()
    assert wal_size(path) == 0, "close() checkpoints and truncates the WAL"
    reopened = ExperienceBuffer(SqliteStorage(path, codec=GROUP_CODEC), BufferConfig())
    served = [int(g.tokens.data[0]) for b in iter(reopened.next_batch, None) for g in b.items]
    assert served == list(range(160))
    reopened.storage.close()


def test_the_writer_enforces_the_bound_when_the_background_checkpoint_never_runs(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    storage = SqliteStorage(path, codec=GROUP_CODEC, checkpoint_bytes=1 << 20, blob_bytes=None)
    storage.checkpointer.checkpoint_bytes = 1 << 62  # the background thread is never asked: as if starved of CPU
    _, largest = fill(path, storage, 100)
    assert storage.checkpointer.forced >= 1, "the writer ran the checkpoints itself"
    assert largest <= storage.checkpointer.wal_limit + ONE_TRANSACTION, f"WAL reached {largest} bytes"
    storage.close()


def test_an_idle_database_truncates_its_wal(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    clock = FakeClock()
    # the background thread never finds it idle
    storage = SqliteStorage(path, codec=GROUP_CODEC, idle_s=1e9, clock=clock)
    buffer = ExperienceBuffer(storage, BufferConfig())
    buffer.register_trainer(registration(batch_size=4))
    for tag in range(40):  # 40 tiny groups: far below checkpoint_bytes, yet megabytes of WAL in 64 KiB pages
        buffer.ingest([make_group([tag])])
    assert wal_size(path) > 1_000_000
    clock.now += 1e9 - 1
    assert storage.checkpointer.idle_checkpoint() is False, "not idle long enough yet"
    clock.now += 1
    assert storage.checkpointer.idle_checkpoint() is True
    assert wal_size(path) == 0
    assert storage.checkpointer.idle_checkpoint() is False, "nothing written since"
    storage.close()


def test_the_background_thread_truncates_the_wal_of_an_idle_database(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    storage = SqliteStorage(path, codec=GROUP_CODEC, idle_s=0.05)
    buffer = ExperienceBuffer(storage, BufferConfig())
    buffer.register_trainer(registration(batch_size=4))
    for tag in range(40):
        buffer.ingest([make_group([tag])])
    deadline = time.monotonic() + 120  # a generous wait for a condition, not a timing claim
    while wal_size(path) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert wal_size(path) == 0
    storage.close()


def test_checkpoint_bytes_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="checkpoint_bytes"):
        SqliteStorage(tmp_path / "x.db", codec=GROUP_CODEC, checkpoint_bytes=0)
    assert not os.path.exists(tmp_path / "x.db")
