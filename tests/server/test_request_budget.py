"""The request memory budget and body read timeouts, driven at the ASGI level with senders that stall.

Each test waits on a condition (the budget's own figures, or the answer arriving), never on elapsed time."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi.testclient import TestClient

from rollhub.server import ServerSettings, create_app
from rollhub.server.budget import RequestBudget
from rollhub.wire import codec
from tests.server.test_extensions import REG
from tests.server.test_fastpath import packed

MiB = 1024 * 1024
DEADLINE_S = 60.0


class Sender:
    """An ASGI ``receive`` for one request: hands out the chunks it is given (``push`` adds more), and waits
    when it has none, for ever unless ``trickle`` (one more chunk every 10 ms) or ``disconnect()``."""

    def __init__(self, *chunks: bytes, more: bool = True, trickle: bytes | None = None) -> None:
        self.chunks = list(chunks)
        self.more = more
        self.trickle = trickle
        self.gone = False
        self.wake = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        while True:
            if self.chunks:
                chunk = self.chunks.pop(0)
                return {"type": "http.request", "body": chunk, "more_body": self.more or bool(self.chunks)}
            if self.gone:
                return {"type": "http.disconnect"}
            if self.trickle is not None:
                await asyncio.sleep(0.01)
                return {"type": "http.request", "body": self.trickle, "more_body": True}
            await self.wake.wait()
            self.wake.clear()

    def push(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.wake.set()

    def disconnect(self) -> None:
        self.gone = True
        self.wake.set()


class Answer:
    """Collects what the app sends for one request."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.done = asyncio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = dict(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
            if not message.get("more_body", False):
                self.done.set()

    def json(self) -> Any:
        return orjson.loads(self.body)


def scope(length: int | None, binary: bool = True, gzipped: bool = False, path: str = "/scored_data") -> dict:
    headers = [(b"content-type", codec.MEDIA_TYPE.encode() if binary else b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    if gzipped:
        headers.append((b"content-encoding", b"gzip"))
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }


async def until(condition: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not condition():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.001)


def run(app: Any, body: Callable[[Any, RequestBudget], Awaitable[None]]) -> None:
    asyncio.run(body(app, app.state.budget))


def make_app(**settings: Any) -> Any:
    app = create_app(ServerSettings(storage="memory", **settings))
    with TestClient(app) as c:  # build the middleware stack and register the trainer
        assert c.post("/register", json=REG).status_code == 200
    return app


def request(app: Any, sender: Sender, **kw: Any) -> tuple[asyncio.Task[None], Answer]:
    answer = Answer()
    length = kw.pop("length", None)
    return asyncio.create_task(app(scope(length, **kw), sender.receive, answer.send)), answer


def test_idle_bodies_hold_nothing_and_a_body_past_the_budget_is_refused_with_503() -> None:
    app = make_app(max_request_memory_bytes=8 * MiB, body_idle_timeout_s=600, body_timeout_s=600)

    async def scenario(app: Any, budget: RequestBudget) -> None:
        idle = [Sender() for _ in range(20)]
        tasks = [request(app, s, length=4 * MiB)[0] for s in idle]
        await until(lambda: budget.bodies_in_flight == 20)
        assert budget.in_flight_bytes == 0, "declared but unsent bodies reserve nothing"
        holders = [Sender(b"\x00" * 1024), Sender(b"\x00" * 1024)]
        tasks += [request(app, s, length=4 * MiB)[0] for s in holders]
        await until(lambda: budget.in_flight_bytes == 8 * MiB)
        for binary in (True, False):  # the fast path and the general path
            body = packed(1) if binary else orjson.dumps({"tokens": [[1]], "masks": [[1]], "scores": [1.0]})
            task, answer = request(app, Sender(body, more=False), length=len(body), binary=binary)
            await task
            assert answer.status == 503
            assert answer.headers[b"retry-after"] == b"1" and answer.headers[b"connection"] == b"close"
            assert "max_request_memory_bytes" in answer.json()["detail"]
        assert budget.refused == 2 and app.state.buffer.counters.groups_in == 0
        for s in idle + holders:
            s.disconnect()
        await asyncio.gather(*tasks)
        assert (budget.in_flight_bytes, budget.bodies_in_flight) == (0, 0)
        task, answer = request(app, Sender(packed(2), more=False), length=len(packed(2)))
        await task
        assert answer.status == 200 and answer.json() == {"status": "received"}
        assert budget.in_flight_bytes == 0

    run(app, scenario)


def test_general_path_reserves_chunks_as_they_arrive_and_gzip_inflation_too() -> None:
    app = make_app(max_request_memory_bytes=1 * MiB, body_idle_timeout_s=600, body_timeout_s=600)

    async def scenario(app: Any, budget: RequestBudget) -> None:
        part = Sender(b" " * 300_000)
        task, answer = request(app, part, binary=False)  # no Content-Length: chunked
        await until(lambda: budget.in_flight_bytes == 300_000)
        part.push(b" " * 800_000)  # 1.1 MB held: past the budget
        await task
        assert answer.status == 503 and budget.in_flight_bytes == 0
        bomb = gzip.compress(b" " * (2 * MiB))  # a few KB that inflate past the budget
        task, answer = request(app, Sender(bomb, more=False), length=len(bomb), binary=False, gzipped=True)
        await task
        assert answer.status == 503 and "max_request_memory_bytes" in answer.json()["detail"]
        assert (budget.in_flight_bytes, budget.bodies_in_flight, budget.refused) == (0, 0, 2)

    run(app, scenario)


def test_a_body_larger_than_the_budget_is_refused_with_413_naming_the_setting() -> None:
    app = make_app(max_request_memory_bytes=1 * MiB)
    with TestClient(app) as c:
        for headers in ({"content-type": codec.MEDIA_TYPE}, {}):
            r = c.post("/scored_data", content=b"\x00" * (MiB + 1), headers=headers)
            assert r.status_code == 413 and "max_request_memory_bytes" in r.json()["detail"]


def test_a_stalled_sender_gets_408_and_its_memory_back() -> None:
    app = make_app(body_idle_timeout_s=0.05, body_timeout_s=600)

    async def scenario(app: Any, budget: RequestBudget) -> None:
        for binary in (True, False):
            task, answer = request(app, Sender(b"\x00" * 1000), length=100_000, binary=binary)
            await task
            assert answer.status == 408 and answer.headers[b"connection"] == b"close"
            assert "body_idle_timeout_s" in answer.json()["detail"]
        assert budget.timeouts == {"idle": 2, "deadline": 0}
        assert (budget.in_flight_bytes, budget.bodies_in_flight) == (0, 0)

    run(app, scenario)


def test_a_trickling_sender_gets_408_at_the_total_deadline() -> None:
    app = make_app(body_idle_timeout_s=600, body_timeout_s=0.2)

    async def scenario(app: Any, budget: RequestBudget) -> None:
        for binary in (True, False):
            sender = Sender(b"\x00", trickle=b"\x00")  # one byte every 10 ms, for ever
            task, answer = request(app, sender, length=10 * MiB, binary=binary)
            await task
            assert answer.status == 408 and "body_timeout_s" in answer.json()["detail"]
        assert budget.timeouts == {"idle": 0, "deadline": 2}
        assert (budget.in_flight_bytes, budget.bodies_in_flight) == (0, 0)

    run(app, scenario)


def test_metrics_show_the_budget_figures() -> None:
    app = make_app(max_request_memory_bytes=3 * MiB)
    with TestClient(app) as c:
        text = c.get("/metrics").text
    for line in (
        "rollhub_request_memory_limit_bytes 3145728",
        "rollhub_request_body_bytes_in_flight 0",
        "rollhub_request_bodies_in_flight 0",
        "rollhub_request_budget_refused_total 0",
        'rollhub_request_body_timeouts_total{reason="idle"} 0',
        'rollhub_request_body_timeouts_total{reason="deadline"} 0',
        "# TYPE rollhub_request_budget_refused_total counter",
    ):
        assert line in text.splitlines()
