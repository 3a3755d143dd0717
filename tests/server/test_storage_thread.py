"""Buffer calls run on the storage thread: a storage commit that blocks never stalls the event loop."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from rollhub.buffer import ExperienceBuffer
from rollhub.buffer.storage import MemoryStorage, Transaction
from rollhub.server import ServerSettings, create_app
from rollhub.server.worker import StorageThread
from rollhub.wire import codec
from tests.server.test_extensions import REG, group

DEADLINE_S = 120.0  # generous: nothing here waits on time, only on events


class HeldStorage(MemoryStorage):
    """Memory storage whose commits wait, while ``held``, until the test releases them (durable: it blocks like
    a disk, so the server runs its calls on the storage thread)."""

    durable = True

    def __init__(self) -> None:
        super().__init__()
        self.held = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def apply(self, tx: Transaction) -> None:
        if self.held:
            self.entered.set()
            self.release.wait(DEADLINE_S)
        super().apply(tx)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_health_answers_while_a_storage_commit_is_blocked(binary: bool) -> None:
    storage = HeldStorage()
    app = create_app(ServerSettings(storage="memory"), buffer=ExperienceBuffer(storage))

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rollhub") as client:
            assert (await client.post("/register", json=REG)).status_code == 200
            storage.held = True
            if binary:
                body = {"content": codec.packb(group(1)), "headers": {"Content-Type": codec.MEDIA_TYPE}}
            else:
                body = {"json": group(1)}
            post = asyncio.create_task(client.post("/scored_data", **body))
            assert await asyncio.to_thread(storage.entered.wait, DEADLINE_S), "the commit never started"
            health = await client.get("/health")  # the loop answers while the commit waits
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert not post.done(), "the ingest cannot finish while its commit is held"
            storage.release.set()
            answer = await post
            assert answer.status_code == 200 and answer.json() == {"status": "received"}
            storage.held = False
            assert (await client.get("/status")).json()["queue_size"] == 1
        assert app.fast_ingest is not None and app.fast_ingest.taken == (1 if binary else 0)

    asyncio.run(scenario())


def test_calls_run_on_one_storage_thread_or_inline_for_storage_that_never_blocks() -> None:
    async def threads(worker: StorageThread) -> tuple[set[int], int]:
        seen = {await worker.run(threading.get_ident) for _ in range(3)}
        worker.close()
        return seen, await worker.run(threading.get_ident)  # a call after close starts a thread again

    here = threading.get_ident()
    assert asyncio.run(threads(StorageThread(inline=True))) == ({here}, here)
    (one,), again = asyncio.run(threads(StorageThread()))
    assert here not in (one, again)
