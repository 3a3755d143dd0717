"""The request memory budget on a real ``rollhub serve`` (uvicorn on loopback): raw sockets that declare 4 MiB
bodies and send nothing (or a little) must not grow the server past the budget, a request past the budget gets
503 with ``Retry-After``, stalled senders get 408 and their connection closed, and normal traffic works after.

Every wait is on a condition (server figures, an answer, a closed socket) with a generous deadline."""

from __future__ import annotations

import re
import select
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import orjson
import psutil
import pytest

from rollhub.run.child_server import ChildServer, rollhub_server
from rollhub.wire import codec
from tests.server.test_extensions import REG
from tests.server.test_fastpath import packed

MiB = 1024 * 1024
DECLARED = 4 * MiB
DEADLINE_S = 120.0


@pytest.fixture
def serve() -> Iterator[Callable[..., ChildServer]]:
    started: list[ChildServer] = []

    def _start(*args: str) -> ChildServer:
        server = rollhub_server("--storage", "memory", *args)
        started.append(server)
        return server.start(timeout_s=120)

    yield _start
    for server in started:
        server.stop()


def figure(client: httpx.Client, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", client.get("/metrics").text, re.MULTILINE)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


def wait_for(condition: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def declare(port: int, body: bytes = b"", json: bool = False) -> socket.socket:
    """A connection that declares a 4 MiB body and sends only ``body`` of it."""
    sock = socket.create_connection(("127.0.0.1", port))
    ctype = "application/json" if json else codec.MEDIA_TYPE
    head = f"POST /scored_data HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {DECLARED}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


def answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP answer, then check the server closed the connection."""
    sock.settimeout(DEADLINE_S)
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"connection closed before an answer: {data!r}"
        data += more
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(rest) < int(headers["content-length"]):
        rest += sock.recv(65536)
    while sock.recv(65536):  # drain to the close
        pass
    sock.close()
    return int(lines[0].split()[1]), headers, rest


def rss(server: ChildServer) -> int:
    assert server.proc is not None
    return psutil.Process(server.proc.pid).memory_info().rss


def test_idle_and_partial_bodies_stay_within_the_budget(serve: Callable[..., ChildServer]) -> None:
    budget = 32 * MiB
    server = serve("--max-request-memory-mb", "32", "--body-idle-timeout", "600", "--body-timeout", "600")
    with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as c:
        c.post("/register", json=REG)
        assert c.post("/scored_data", content=packed(1), headers={"Content-Type": codec.MEDIA_TYPE}).status_code == 200
        base = rss(server)
        idle = [declare(server.port) for _ in range(80)]
        wait_for(lambda: figure(c, "rollhub_request_bodies_in_flight") == 80, "80 bodies in flight")
        assert figure(c, "rollhub_request_body_bytes_in_flight") == 0
        grown_idle = rss(server) - base
        partial = [declare(server.port, b"\x00" * 65536) for _ in range(12)]  # 8 fit the budget, 4 do not
        wait_for(lambda: figure(c, "rollhub_request_budget_refused_total") == 4, "4 refusals")
        assert figure(c, "rollhub_request_body_bytes_in_flight") == budget
        grown = rss(server) - base
        declared_total = (len(idle) + len(partial)) * DECLARED
        assert grown_idle < 16 * MiB, f"80 idle 4 MiB bodies grew the server by {grown_idle} bytes"
        assert grown < budget + 32 * MiB < declared_total / 4, f"grew {grown} bytes for {declared_total} declared"
        refused = []
        while len(refused) < 4:
            ready, _, _ = select.select(partial, [], [], DEADLINE_S)
            assert ready, "the refused connections were not answered"
            for sock in ready:
                partial.remove(sock)
                refused.append(answer(sock))
        for status, headers, body in refused:
            assert status == 503 and headers["retry-after"] == "1"
            assert "max_request_memory_bytes" in orjson.loads(body)["detail"]
        for headers, content in (({"Content-Type": codec.MEDIA_TYPE}, packed(2)), ({}, b'{"tokens": []}')):
            r = c.post("/scored_data", content=content, headers=headers)  # the fast path, then the general one
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        for sock in idle + partial:
            sock.close()
        wait_for(lambda: figure(c, "rollhub_request_bodies_in_flight") == 0, "every body released")
        assert figure(c, "rollhub_request_body_bytes_in_flight") == 0
        r = c.post("/scored_data", content=packed(3), headers={"Content-Type": codec.MEDIA_TYPE})
        assert r.status_code == 200 and r.json() == {"status": "received"}
        assert c.get("/status").json()["queue_size"] == 2


def test_stalled_senders_get_408_and_are_closed(serve: Callable[..., ChildServer]) -> None:
    server = serve("--body-idle-timeout", "1", "--body-timeout", "600")
    with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as c:
        c.post("/register", json=REG)
        stalled = [declare(server.port) for _ in range(20)]
        stalled += [declare(server.port, b"\x00" * 65536, json=k % 2 == 1) for k in range(6)]
        for sock in stalled:
            status, headers, body = answer(sock)
            assert status == 408 and headers["connection"] == "close"
            assert "body_idle_timeout_s" in orjson.loads(body)["detail"]
        assert figure(c, 'rollhub_request_body_timeouts_total{reason="idle"}') == 26
        assert figure(c, "rollhub_request_body_bytes_in_flight") == 0
        wait_for(lambda: figure(c, "rollhub_request_bodies_in_flight") == 0, "every body released")
        r = c.post("/scored_data", content=packed(1), headers={"Content-Type": codec.MEDIA_TYPE})
        assert r.status_code == 200 and r.json() == {"status": "received"}
