"""A full disk over HTTP: ingest answers 503 + Retry-After naming the cause; batches, leases and acks go on."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from rollhub.buffer import BufferConfig, ExperienceBuffer
from rollhub.buffer.sqlite import SqliteStorage
from rollhub.server import ServerSettings, create_app
from rollhub.server.storage import GROUP_CODEC
from tests.conftest import registration_body

REG = registration_body(4)


def group(tag: int) -> dict[str, Any]:
    return {"tokens": [[tag, i] for i in range(4)], "masks": [[tag, i] for i in range(4)], "scores": [1.0] * 4}


class Disk:
    """The segment files' disk: writes fail with ENOSPC while ``full``, and its free space reads accordingly."""

    def __init__(self) -> None:
        self.full = False

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.pwrite(fd, data, offset)

    def free(self, directory: Path) -> int:
        return 0 if self.full else 1 << 40


def test_a_full_disk_refuses_posts_with_503_and_the_trainer_still_drains(tmp_path: Path) -> None:
    storage = SqliteStorage(tmp_path / "b.db", codec=GROUP_CODEC, blob_bytes=1)  # every payload goes to a segment file
    disk = Disk()
    storage.blobs.pwrite = disk.pwrite
    storage.reserve.free_bytes = disk.free
    app = create_app(ServerSettings(), buffer=ExperienceBuffer(storage, BufferConfig()))
    with TestClient(app) as c:
        assert c.post("/register", json=REG).status_code == 200
        for tag in range(3):
            assert c.post("/scored_data", json=group(tag)).status_code == 200
        disk.full = True
        refused = c.post("/scored_data", json=group(99))
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "5"
        assert refused.json()["detail"][0]["type"] == "StorageFull"
        assert "is full" in refused.json()["detail"][0]["msg"]
        assert c.post("/scored_data_list", json=[group(98)]).status_code == 503
        assert c.get("/status").json()["storage"]["disk_full"] is True
        leased = c.get("/batch", params={"lease_s": 60}).json()
        assert leased["batch"][0]["tokens"][0][0] == 0
        assert c.post("/ack", json={"batch_id": leased["batch_id"]}).status_code == 200
        assert c.get("/batch").json()["batch"][0]["tokens"][0][0] == 1
        disk.full = False  # space came back: accepted again with no call needed
        assert c.post("/scored_data", json=group(3)).status_code == 200
        assert c.get("/status").json()["storage"]["disk_full"] is False
        served = [c.get("/batch").json()["batch"][0]["tokens"][0][0] for _ in range(2)]
        assert served == [2, 3]
        assert c.get("/batch").json()["batch"] is None
