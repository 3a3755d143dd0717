"""Fixtures of the client tests: real servers (rollhub and the published AtroposLib 0.4.0) as subprocesses on
free loopback ports, always stopped by the test that started them, and helpers to drive handlers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollhub.client import HandlerStats, RolloutHandler, TrainerClient
from rollhub.experience import Group
from rollhub.run import child_server as child
from rollhub.run.child_server import ChildServer
from tests.conftest import ServerProcess


def _reset(url: str) -> None:
    answer = httpx.get(url + "/reset_data", timeout=30)
    assert answer.status_code == 200, answer.text


def new_server(kind: str) -> ChildServer:
    """A server of ``kind`` (``"rollhub"``: ``rollhub serve --storage memory``; ``"atropos"``: the published 0.4.0),
    started; the caller stops it. Skips the test where atroposlib is not installed."""
    if kind == "atropos":
        pytest.importorskip(
            "atroposlib", reason="atroposlib 0.4.0 is not installed (make setup installs it into .venv/reference)"
        )
        return child.atropos_server().start()
    return ServerProcess("--storage", "memory").start()


@pytest.fixture(scope="session")
def _atropos_shared() -> Iterator[ChildServer]:
    server = new_server("atropos")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _rollhub_shared() -> Iterator[ChildServer]:
    server = new_server("rollhub")
    yield server
    server.stop()


@pytest.fixture
def atropos_server(_atropos_shared: ChildServer) -> ChildServer:
    """The published 0.4.0 server (shared by the session, reset for each test)."""
    _reset(_atropos_shared.url)
    return _atropos_shared


@pytest.fixture
def rollhub_server(_rollhub_shared: ChildServer) -> ChildServer:
    """``rollhub serve --storage memory`` (shared by the session, reset for each test)."""
    _reset(_rollhub_shared.url)
    return _rollhub_shared


@pytest.fixture(params=["rollhub", "atropos"])
def any_server(request: pytest.FixtureRequest) -> Any:
    """The same test against rollhub (msgpack) and against AtroposLib 0.4.0 (JSON fallback)."""
    return request.getfixturevalue(f"{request.param}_server")


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after a generous timeout (no timing claims)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


def start_trainer(url: str, batch_size: int = 4, **fields: Any) -> TrainerClient:
    """Register a trainer and make its first batch request, so environments may register."""
    trainer = TrainerClient(url)
    trainer.register(batch_size=batch_size, max_token_len=64, num_steps=100, **fields)
    trainer.get_batch()
    return trainer


def drain(trainer: TrainerClient) -> list[Group]:
    """Pull batches until none is ready; return their groups."""
    groups: list[Group] = []
    while (batch := trainer.get_batch()) is not None:
        groups.extend(batch)
    return groups


def toy_group(tag: int, n: int = 2) -> dict[str, Any]:
    """A group whose sequences all start with ``tag``, so a served group can be identified."""
    return {
        "tokens": [[tag, 7, i] for i in range(n)],
        "masks": [[-100, 7, i] for i in range(n)],
        "scores": [float(i % 2) for i in range(n)],
    }


class CountingHandler(RolloutHandler):
    """Collects tagged toy groups (tags 1, 2, 3, ...) and remembers every tag it produced."""

    def __init__(self, url: str, **settings: Any) -> None:
        settings.setdefault("name", "toy")
        settings.setdefault("group_size", 2)
        settings.setdefault("max_token_length", 64)
        settings.setdefault("status_interval_s", 0.05)
        super().__init__(url, **settings)
        self.tags: list[int] = []

    def collect(self) -> dict[str, Any]:
        tag = len(self.tags) + 1
        self.tags.append(tag)
        self.log_metrics({"reward": 1.0})
        return toy_group(tag, self.group_size)


class Running:
    """A handler's ``run`` in a thread; ``join`` returns its stats or re-raises its error."""

    def __init__(self, handler: RolloutHandler, **kwargs: Any) -> None:
        self.handler = handler
        self.result: HandlerStats | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, kwargs=kwargs, daemon=True)
        self.thread.start()

    def _run(self, **kwargs: Any) -> None:
        try:
            self.result = self.handler.run(**kwargs)
        except BaseException as exc:
            self.error = exc

    def join(self, timeout_s: float = 60.0) -> HandlerStats:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the handler did not return"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def stop(self) -> HandlerStats:
        self.handler.stop()
        return self.join()


@pytest.fixture
def running() -> Iterator[Callable[..., Running]]:
    """``running(handler, **run_kwargs)`` starts a handler thread; every one is stopped after the test."""
    started: list[Running] = []

    def start(handler: RolloutHandler, **kwargs: Any) -> Running:
        started.append(Running(handler, **kwargs))
        return started[-1]

    yield start
    for r in started:
        r.handler.stop()
        r.thread.join(30)


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]
