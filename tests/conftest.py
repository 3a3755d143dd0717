"""Shared fixtures: free loopback ports and `rollhub serve` subprocesses that tests start and stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A ``python -m rollhub serve`` child process on a free loopback port."""

    def __init__(self, *args: str, port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> ServerProcess:
        cmd = [sys.executable, "-m", "rollhub", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--log-level", "warning", *self.args]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"rollhub serve exited with {self.proc.returncode}: {err}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"rollhub serve did not answer on {self.url} within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers run (the crash case)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc and self.proc.stderr:
            self.proc.stderr.close()


@pytest.fixture
def server_factory() -> Iterator[type[ServerProcess]]:
    """Start servers with ``server_factory(*cli_args).start()``; all are stopped after the test."""
    started: list[ServerProcess] = []

    class _Tracked(ServerProcess):
        def start(self, timeout_s: float = 20.0) -> ServerProcess:
            started.append(self)
            return super().start(timeout_s)

    yield _Tracked
    for server in started:
        server.stop()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'rollhub.db'}"
