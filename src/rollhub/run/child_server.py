"""Child server processes on free loopback ports: the one launcher of runs, demos, tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildServer:
    """A server started as a child process on 127.0.0.1; ``start()`` returns once ``probe`` answers.

    Args:
        cmd: the command; ``{port}`` in any argument is replaced by the chosen port.
        probe: the path polled until it answers 200.
        port: the port to use (a free one by default).
        env: extra environment variables for the child.
        name: how errors name the server.
    """

    def __init__(
        self,
        cmd: list[str],
        *,
        probe: str = "/",
        port: int | None = None,
        env: dict[str, str] | None = None,
        name: str = "server",
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [part.replace("{port}", str(self.port)) for part in cmd]
        self.probe = probe
        self.env = {**os.environ, **(env or {})}
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> ChildServer:
        """Start the child and wait until it answers; raise (and stop it) if it exits or stays silent.

        The child runs in a session of its own, so a Ctrl-C at the terminal reaches only the parent, which
        stops the child after it has finished with it (see :meth:`stop`).
        """
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}: {err[-2000:]}")
            try:
                if httpx.get(self.url + self.probe, timeout=1.0).status_code == 200:
                    self._release_stderr()
                    return self
            except httpx.TransportError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.name} did not answer on {self.url} within {timeout_s} s")

    def _release_stderr(self) -> None:
        # Nobody reads the pipe once the server is up; closing our end keeps a chatty child from blocking on it.
        if self.proc and self.proc.stderr:
            self.proc.stderr.close()
            self.proc.stderr = None

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers run (the crash case)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """Terminate the child (SIGKILL if it does not exit within 10 s)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._release_stderr()


def rollhub_command(*args: str) -> list[str]:
    """``python -m rollhub serve`` on 127.0.0.1 at ``{port}``, quiet, with ``args`` added."""
    cmd = [sys.executable, "-m", "rollhub", "serve", "--host", "127.0.0.1", "--port", "{port}"]
    return [*cmd, "--log-level", "warning", *args]


def rollhub_server(*args: str, port: int | None = None, env: dict[str, str] | None = None) -> ChildServer:
    """A ``python -m rollhub serve ARGS`` child on 127.0.0.1 (not started yet)."""
    return ChildServer(rollhub_command(*args), probe="/health", port=port, env=env, name="rollhub serve")


def atropos_server(port: int | None = None) -> ChildServer:
    """The published AtroposLib server (``python -m atroposlib.cli.run_api``) as a child (not started yet)."""
    cmd = [sys.executable, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1", "--port", "{port}"]
    return ChildServer(cmd, port=port, name="atroposlib run_api")


def start_server(storage: str, *extra: str, timeout_s: float = 30.0) -> ChildServer:
    """Start ``rollhub serve --storage STORAGE EXTRA...`` and wait until it answers."""
    return rollhub_server("--storage", storage, *extra).start(timeout_s)
