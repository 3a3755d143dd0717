"""A full disk, for real: run as ``python full_disk_scenario.py DIR`` on a small file system mounted at DIR.

Fills the disk with ~288 KB groups until ingest is refused, serves and acknowledges while it is full, checks that
consumed data frees space and ingest resumes by itself, fills it again, restarts, and drains. Prints one JSON
object with what it saw; the test that runs it (test_sqlite_full_disk.py) asserts on it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from buffer_support import heavy_group, registration

from rollhub.buffer import BufferConfig, ExperienceBuffer
from rollhub.buffer.sqlite import SqliteStorage
from rollhub.errors import StorageFull
from rollhub.server.storage import GROUP_CODEC


def free(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def open_buffer(path: Path, inline: bool) -> ExperienceBuffer:
    """``inline``: payloads stay in SQLite (no segment files), so SQLite itself meets the full disk."""
    storage = SqliteStorage(path, codec=GROUP_CODEC, reserve_bytes=1 << 20, blob_bytes=None if inline else 64 * 1024)
    buffer = ExperienceBuffer(storage, BufferConfig())
    if buffer.run is None:
        buffer.register_trainer(registration(batch_size=9))
    return buffer


def fill(buffer: ExperienceBuffer, tags: range, accepted: list[int]) -> list[str]:
    """Ingest until three groups in a row are refused; returns the refusals' messages."""
    refusals: list[str] = []
    for tag in tags:
        try:
            buffer.ingest([heavy_group(tag, rows=9)])  # 9 x 4096 x 2 int32: ~295 KB
        except StorageFull as exc:
            refusals.append(exc.message)
            if len(refusals) >= 3:
                break
        else:
            accepted.append(tag)
            refusals.clear()
    return refusals


def tags_of(batch: object) -> list[int]:
    return [int(g.tokens.data[0]) for g in batch.items]  # type: ignore[attr-defined]


def main(directory: Path, inline: bool) -> dict[str, object]:
    path = directory / "rollhub.db"
    out: dict[str, object] = {"disk_bytes": free(directory)}
    buffer = open_buffer(path, inline)
    accepted: list[int] = []
    served: list[int] = []
    out["first_refusal"] = fill(buffer, range(0, 1000), accepted)[:1]
    out["accepted_first_fill"] = len(accepted)
    out["status_when_full"] = buffer.status().storage
    leased = buffer.next_batch(lease_s=60)  # serving and acknowledging while the disk is full
    out["leased_while_full"] = leased is not None
    if leased is not None:
        buffer.ack(leased.batch_id)  # type: ignore[arg-type]
        served += tags_of(leased)
    before = free(directory)
    for _ in range(max(1, len(accepted) // 2 - 1)):
        batch = buffer.next_batch()
        if batch is None:
            break
        served += tags_of(batch)
    out["freed_by_consuming"] = free(directory) - before
    out["refilled"] = fill(buffer, range(1000, 2000), accepted)[:1]
    out["accepted_total"] = len(accepted)
    out["status_before_restart"] = buffer.status().storage
    buffer.storage.close()
    reopened = open_buffer(path, inline)
    while (batch := reopened.next_batch()) is not None:
        served += tags_of(batch)
    out["status_after_restart"] = reopened.status().storage
    reopened.storage.close()
    again = open_buffer(path, inline)
    out["served_after_second_restart"] = [t for b in iter(again.next_batch, None) for t in tags_of(b)]
    again.storage.close()
    out["accepted"] = accepted
    out["served"] = served
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), inline=sys.argv[2:] == ["inline"])))
