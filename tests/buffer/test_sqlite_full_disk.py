"""A full disk refuses new data and corrupts nothing; serving, acknowledging and restarts go on; space comes back.

Always run: ENOSPC injected at the blob log's write primitive (short writes included) and a database that cannot
grow (``max_page_count``). Where a small file system can be mounted (root, or a user namespace), the same is run
for real on an 8 MiB tmpfs.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from buffer_support import drain, heavy_group, make_group, served_tokens
from buffer_support import open_sqlite_buffer as open_buffer

from rollhub.buffer import ExperienceBuffer
from rollhub.buffer.sqlite import SqliteStorage
from rollhub.errors import StorageFull
from rollhub.server.errors import render
from rollhub.wire.codec import pack_group

HERE = Path(__file__).parent


class FillingDisk:
    """A disk with ``room`` bytes left, as the blob log writes to it (``os.pwrite``) and sees its free space.

    Each write puts at most ``chunk`` bytes (a short write), and at most what room is left; with no room left it
    raises ``OSError(ENOSPC)``, as the kernel does. :meth:`free` is its ``statvfs``.
    """

    def __init__(self, room: int, chunk: int = 50_000) -> None:
        self.room = room
        self.chunk = chunk

    def __call__(self, fd: int, data: memoryview, offset: int) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = os.pwrite(fd, data[: min(len(data), self.chunk, self.room)], offset)
        self.room -= n
        return n

    def free(self, directory: Path) -> int:
        return self.room

    def attach(self, storage: SqliteStorage) -> None:
        storage.blobs.pwrite = self
        storage.reserve.free_bytes = self.free


def ingest_all(buffer: ExperienceBuffer, tags: range) -> tuple[list[int], list[int]]:
    accepted, refused = [], []
    for tag in tags:
        try:
            buffer.ingest([heavy_group(tag)])
        except StorageFull:
            refused.append(tag)
        else:
            accepted.append(tag)
    return accepted, refused


def test_a_blob_write_cut_short_by_a_full_disk_is_undone_and_every_acknowledged_group_survives(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    buffer = open_buffer(path)
    storage = buffer.storage
    assert isinstance(storage, SqliteStorage)
    blob = len(pack_group(heavy_group(0)))
    disk = FillingDisk(room=2 * blob + blob // 2)  # two groups, then the third fails part way through
    disk.attach(storage)
    accepted, refused = ingest_all(buffer, range(5))
    assert accepted == [0, 1] and refused == [2, 3, 4]
    (segment,) = Path(f"{path}.blobs").glob("*.seg")
    assert segment.stat().st_size == storage.blobs.mark()[1] == 2 * blob, "the partial blob was cut off again"
    assert storage.stats()["disk_full"] is True
    assert storage.stats()["refused_full"] == 3
    leased = buffer.next_batch(lease_s=60)  # serving and acknowledging need no new blob space
    assert leased is not None and [int(g.tokens.data[0]) for g in leased.items] == [0]
    buffer.ack(leased.batch_id)  # type: ignore[arg-type]
    disk.room = 10**9  # space came back: new data is accepted again, with no call needed
    accepted += ingest_all(buffer, range(5, 8))[0]
    assert storage.stats()["disk_full"] is False
    assert accepted == [0, 1, 5, 6, 7]
    accepted.remove(0)  # served and acknowledged above
    storage.close()
    reopened = open_buffer(path)  # a restart: every acknowledged group is there, intact, once
    assert drain(reopened) == accepted
    assert reopened.status().storage["quarantined"] == 0
    reopened.storage.close()
    again = open_buffer(path)
    assert drain(again) == [], "nothing is served twice after a restart"
    again.storage.close()


def test_short_writes_are_completed(tmp_path: Path) -> None:
    buffer = open_buffer(tmp_path / "b.db")
    FillingDisk(room=10**9, chunk=777).attach(buffer.storage)  # type: ignore[arg-type]
    assert ingest_all(buffer, range(4)) == ([0, 1, 2, 3], [])
    assert drain(buffer) == [0, 1, 2, 3]
    buffer.storage.close()


def test_a_database_that_cannot_grow_refuses_new_data_but_serves_and_acknowledges(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    buffer = open_buffer(path)
    storage = buffer.storage
    assert isinstance(storage, SqliteStorage)
    pages = storage._db.execute("PRAGMA page_count").fetchone()[0]
    storage._db.execute(f"PRAGMA max_page_count={pages}")  # SQLITE_FULL for anything that needs a new page
    accepted: list[int] = []
    for tag in range(5000):  # small groups stay inside SQLite; the table's pages fill up after some hundreds
        try:
            buffer.ingest([make_group([tag] * 4)])
        except StorageFull:
            break
        accepted.append(tag)
    assert 0 < len(accepted) < 5000
    assert buffer.status().storage["disk_full"] is True
    with pytest.raises(StorageFull, match="new data is refused"):
        buffer.ingest([make_group([9999] * 4)])
    leased = buffer.next_batch(lease_s=60)
    assert leased is not None
    buffer.ack(leased.batch_id)  # type: ignore[arg-type]
    served = served_tokens(leased)[::4]
    served += [t for b in iter(buffer.next_batch, None) for t in served_tokens(b)[::4]]
    assert served == accepted
    storage.close()
    reopened = open_buffer(path)
    assert drain(reopened) == [], "served and acknowledged while full, and so never again"
    reopened.storage.close()


def test_consumed_groups_give_their_disk_blocks_back(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    buffer = open_buffer(path)  # one 256 MiB segment: nothing is freed by deleting segments
    ingest_all(buffer, range(12))
    (segment,) = Path(f"{path}.blobs").glob("*.seg")
    before = segment.stat().st_blocks * 512
    assert drain(buffer)[:8] == list(range(8))
    after = segment.stat().st_blocks * 512
    if after == before:
        pytest.skip(f"the file system under {tmp_path} cannot punch holes (fallocate PUNCH_HOLE)")
    assert after < before - 1_000_000, f"blocks {before} -> {after}: consumed blobs free their space"
    assert segment.stat().st_size >= 12 * 131_000, "the segment keeps its size (later offsets stay valid)"
    buffer.storage.close()


def test_a_full_disk_answers_503_with_retry_after() -> None:
    status, headers, body = render(StorageFull("the disk holding x.db is full"))
    assert status == 503
    assert (b"retry-after", b"5") in headers
    assert b"StorageFull" in body and b"is full" in body


def _mounted_run(mode: str) -> dict[str, object]:
    """Run full_disk_scenario.py on an 8 MiB tmpfs mounted in a private mount namespace (skip if impossible)."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        pytest.skip("needs Linux and unshare(1) to mount a small file system")
    script = (
        'd=$(mktemp -d) || exit 97; if ! mount -t tmpfs -o size=8m tmpfs "$d"; then rmdir "$d"; exit 97; fi; '
        f'echo mounted >&2; "{sys.executable}" "{HERE / "full_disk_scenario.py"}" "$d" {mode}; '
        'rc=$?; umount "$d"; rmdir "$d"; exit $rc'
    )
    reasons = []
    for flags in (["-m", "--propagation", "private"], ["-r", "-m", "--propagation", "private"]):
        run = subprocess.run([unshare, *flags, "sh", "-c", script], capture_output=True, text=True, timeout=600)
        if run.returncode == 0:
            return json.loads(run.stdout.strip().splitlines()[-1])
        if "mounted" in run.stderr.splitlines():  # the file system was there: the scenario itself failed
            raise AssertionError(f"the full-disk scenario failed:\n{run.stderr[-4000:]}")
        reasons.append(run.stderr.strip()[-200:])
    pytest.skip(f"cannot mount a tmpfs here (needs root or user namespaces): {reasons}")


@pytest.mark.parametrize("mode", ["blobs", "inline"])
def test_a_real_full_disk(mode: str) -> None:
    seen = _mounted_run(mode)
    assert "is full" in seen["first_refusal"][0]  # type: ignore[index]
    assert seen["status_when_full"]["disk_full"] is True  # type: ignore[index]
    assert seen["leased_while_full"] is True, "serving and acknowledging work while the disk is full"
    assert seen["served"] == seen["accepted"], "every acknowledged group is delivered, in order, once"
    assert seen["served_after_second_restart"] == []
    assert seen["status_after_restart"]["quarantined"] == 0  # type: ignore[index]
    if mode == "blobs":
        assert seen["freed_by_consuming"] > 1_000_000, "consumed groups free space on the disk"  # type: ignore[operator]
        assert len(seen["accepted"]) > seen["accepted_first_fill"], "ingest resumed by itself"  # type: ignore[arg-type]
