"""Shared fixtures: free loopback ports and `rollhub serve` subprocesses that tests start and stop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollhub.demos.serve import ChildServer, free_port, rollhub_command

__all__ = ["ServerProcess", "free_port"]


class ServerProcess(ChildServer):
    """A ``python -m rollhub serve ARGS`` child process on a free loopback port."""

    def __init__(self, *args: str, port: int | None = None, env: dict[str, str] | None = None) -> None:
        super().__init__(rollhub_command(*args), probe="/health", port=port, env=env, name="rollhub serve")


@pytest.fixture
def server_factory() -> Iterator[type[ServerProcess]]:
    """Start servers with ``server_factory(*cli_args).start()``; all are stopped after the test."""
    started: list[ServerProcess] = []

    class _Tracked(ServerProcess):
        def start(self, timeout_s: float = 30.0) -> ChildServer:
            started.append(self)
            return super().start(timeout_s)

    yield _Tracked
    for server in started:
        server.stop()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'rollhub.db'}"
