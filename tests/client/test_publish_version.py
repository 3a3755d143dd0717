"""``TrainerClient.publish_version`` (and the async twin) over real HTTP against a small fake server on loopback.

The fake speaks the ``POST /policy-version`` contract: it holds the published version, refuses one that goes
backwards with 409 naming ``policy_version``, drops queued items older than its staleness bound allows and says
how many, and reports the version in ``/status``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollhub.client import (
    AsyncTrainerClient,
    PolicyVersionConflict,
    PublishedVersion,
    RequestRejected,
    TrainerClient,
)
from rollhub.errors import InvalidInput, Unauthorized
from tests.conftest import free_port

KEY = "s3cret"


@dataclass
class FakeBuffer:
    """What the fake server holds: the published version and the versions of its queued items."""

    queued: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    max_staleness: int = 1
    version: int | None = None
    bodies: list[Any] = field(default_factory=list)

    def app(self, with_route: bool = True) -> Starlette:
        routes = [Route("/status", self.status)]
        if with_route:
            routes.append(Route("/policy-version", self.publish, methods=["POST"]))
        return Starlette(routes=routes)

    async def status(self, request: Request) -> JSONResponse:
        return JSONResponse({"current_step": 0, "queue_size": len(self.queued), "policy_version": self.version})

    async def publish(self, request: Request) -> JSONResponse:
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return JSONResponse({"detail": "missing or wrong API key"}, status_code=401)
        body = await request.json()
        self.bodies.append(body)
        version = body["policy_version"]
        if self.version is not None and version < self.version:
            detail = [
                {
                    "loc": ["body", "policy_version"],
                    "msg": f"policy_version {version} is lower than the current {self.version}",
                }
            ]
            return JSONResponse({"detail": detail}, status_code=409)
        self.version = version
        kept = [p for p in self.queued if version - p <= self.max_staleness]
        dropped, self.queued = len(self.queued) - len(kept), kept
        return JSONResponse({"policy_version": version, "stale_dropped": dropped})


class Served:
    """A uvicorn server for an ASGI app on a free loopback port, in a thread."""

    def __init__(self, app: Starlette) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive(), "the fake server failed to start"
            assert time.monotonic() < deadline, "the fake server did not start within 60 s"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture
def fake() -> Iterator[tuple[FakeBuffer, str]]:
    buffer = FakeBuffer()
    with Served(buffer.app()) as served:
        yield buffer, served.url


def test_publish_version_posts_the_version_and_returns_what_the_bound_dropped(fake: tuple[FakeBuffer, str]) -> None:
    buffer, url = fake
    with TrainerClient(url, api_key=KEY) as trainer:
        assert trainer.status().policy_version is None, "nothing published yet"
        assert trainer.publish_version(0) == PublishedVersion(policy_version=0, stale_dropped=0)
        published = trainer.publish_version(3)
        assert (published.policy_version, published.stale_dropped) == (3, 2)  # items of versions 0 and 1
        assert trainer.publish_version(3).stale_dropped == 0, "publishing the same version again is allowed"
        assert trainer.status().policy_version == 3
    assert buffer.bodies == [{"policy_version": 0}, {"policy_version": 3}, {"policy_version": 3}]
    assert buffer.queued == [2, 3]


def test_a_version_going_backwards_is_a_clear_error_naming_policy_version(fake: tuple[FakeBuffer, str]) -> None:
    buffer, url = fake
    with TrainerClient(url, api_key=KEY) as trainer:
        trainer.publish_version(5)
        with pytest.raises(PolicyVersionConflict, match="policy_version") as refused:
            trainer.publish_version(4)
    assert refused.value.policy_version == 4 and refused.value.field == "policy_version"
    assert "409" in str(refused.value) and "lower than the current 5" in str(refused.value)
    assert buffer.version == 5, "the server kept its version"


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", None])
def test_a_bad_version_is_refused_before_anything_is_sent(fake: tuple[FakeBuffer, str], bad: Any) -> None:
    buffer, url = fake
    with TrainerClient(url, api_key=KEY) as trainer, pytest.raises(InvalidInput, match="policy_version") as info:
        trainer.publish_version(bad)
    assert info.value.field == "policy_version" and buffer.bodies == []


def test_the_api_key_is_sent(fake: tuple[FakeBuffer, str]) -> None:
    _, url = fake
    with TrainerClient(url, api_key="wrong") as trainer, pytest.raises(Unauthorized, match="api_key"):
        trainer.publish_version(1)


def test_async_publish_version(fake: tuple[FakeBuffer, str]) -> None:
    buffer, url = fake

    async def scenario() -> None:
        async with AsyncTrainerClient(url, api_key=KEY) as trainer:
            assert (await trainer.publish_version(2)).stale_dropped == 1
            with pytest.raises(PolicyVersionConflict, match="policy_version 1"):
                await trainer.publish_version(1)
            assert (await trainer.status()).policy_version == 2

    asyncio.run(scenario())
    assert buffer.bodies == [{"policy_version": 2}, {"policy_version": 1}]


def test_a_server_without_the_route_says_so() -> None:
    with (
        Served(FakeBuffer().app(with_route=False)) as served,
        TrainerClient(served.url) as trainer,
        pytest.raises(RequestRejected, match="not served by this server") as info,
    ):
        trainer.publish_version(1)
    assert info.value.status_code in (404, 405)
