"""Fixtures of the buffer tests: every storage backend, a fake clock, and small builders."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollhub.buffer import BufferConfig, ExperienceBuffer, Storage, make_storage
from rollhub.server.storage import GROUP_CODEC


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(params=["memory", "sqlite"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A storage URL for each backend."""
    return "memory" if request.param == "memory" else f"sqlite:///{tmp_path}/buf.db"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def open_storage(storage_url: str) -> Iterator[Callable[[], Storage]]:
    """Opens the fixture's backend; a second call reopens the same data (memory: the same object)."""
    opened: list[Storage] = []
    memory = make_storage("memory") if storage_url == "memory" else None

    def _open() -> Storage:
        storage = memory if memory is not None else make_storage(storage_url, GROUP_CODEC)
        opened.append(storage)
        return storage

    yield _open
    for storage in opened:
        storage.close()


@pytest.fixture
def make_buffer(open_storage: Callable[[], Storage], clock: FakeClock) -> Callable[..., ExperienceBuffer]:
    """Build an ExperienceBuffer on the fixture's backend (call again to simulate a restart)."""

    def _make(**config: object) -> ExperienceBuffer:
        return ExperienceBuffer(open_storage(), BufferConfig(**config), clock=clock)  # type: ignore[arg-type]

    return _make


@pytest.fixture
def buffer(make_buffer: Callable[..., ExperienceBuffer]) -> ExperienceBuffer:
    """A buffer with default configuration on each backend."""
    return make_buffer()
