"""Start and stop a ``rollhub serve`` child process on a free loopback port (used by the demos)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


class ServerHandle:
    """A running ``rollhub serve`` child; ``stop()`` terminates it."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc = proc
        self.url = url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(storage: str, *extra: str, timeout_s: float = 30.0) -> ServerHandle:
    """Start ``rollhub serve --storage STORAGE`` on 127.0.0.1 and wait until it answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "rollhub", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--storage", storage, "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rollhub serve exited with status {proc.returncode}")
        try:
            httpx.get(handle.url + "/health", timeout=1.0)
            return handle
        except httpx.TransportError:
            time.sleep(0.05)
    handle.stop()
    raise TimeoutError(f"rollhub serve did not answer on {handle.url} within {timeout_s} s")
