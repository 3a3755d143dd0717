"""Every documented command, run as a user types it: the venv's console scripts as subprocesses on free ports.

Each server runs in a process group of its own and is stopped by signalling the whole group (``--reload`` runs the
server in a child of uvicorn's reloader), after which the test checks that no process of the group is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from rollhub.cli import DEFAULT_DEMO, DEMOS
from tests.conftest import REFERENCE_DIR, free_port, registration_body

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
READY_S = 120.0
KEY = "s3cret-key"


class Command:
    """A documented command started in its own process group; output goes to a log file read on failure."""

    def __init__(self, argv: list[str], *, cwd: Path, logs: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        logs.mkdir(parents=True, exist_ok=True)
        self.log = logs / f"{Path(argv[0]).name}-{time.monotonic_ns()}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pgid = self.proc.pid  # a new session: the leader's pid is the group id

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_ready(self, url: str, deadline_s: float = READY_S) -> None:
        """Poll ``url`` until it answers 200; fail with the command's output if it exits or stays silent."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.argv} exited with {self.proc.returncode} before serving:\n{self.output()}")
            try:
                answer = httpx.get(url, timeout=5)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if answer.status_code == 200:
                return
            if answer.status_code >= 500:
                pytest.fail(
                    f"{self.argv} answered {url} with {answer.status_code}: {answer.text[:500]}\n{self.output()}"
                )
            time.sleep(0.2)
        pytest.fail(f"{self.argv} did not answer {url} within {deadline_s} s:\n{self.output()}")

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the whole group; SIGKILL to what is left after ``grace_s``; reap the leader."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not self.group_alive():
                    return
                time.sleep(0.1)
        self.proc.wait(30)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[type[Command]]:
    """``launch(argv, cwd=...)`` starts a command; every one is stopped (its whole process group) after the test."""
    started: list[Command] = []
    logs = tmp_path / "logs"

    class _Tracked(Command):
        def __init__(self, argv: list[str], *, cwd: Path = REPO, env: dict[str, str] | None = None) -> None:
            super().__init__(argv, cwd=cwd, logs=logs, env=env)
            started.append(self)

    try:
        yield _Tracked  # type: ignore[misc]
    finally:
        for command in started:
            command.stop()


def run(*argv: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run a command to completion from the repository root (as the documentation's commands are typed)."""
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)


def workdir(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir(exist_ok=True)
    return path


# ---------------------------------------------------------------- serving


@pytest.mark.parametrize("storage", ["memory", "sqlite"])
def test_uvicorn_serves_rollhub_server_app(launch: type[Command], tmp_path: Path, storage: str) -> None:
    """``uvicorn rollhub.server:app --port P``, configured from ROLLHUB_* variables."""
    url = "memory" if storage == "memory" else f"sqlite:///{tmp_path / 'uv.db'}"
    port = free_port()
    launch(
        [str(BIN / "uvicorn"), "rollhub.server:app", "--port", str(port)],
        cwd=workdir(tmp_path),
        env={"ROLLHUB_STORAGE": url, "ROLLHUB_MAX_STALENESS": "3"},
    ).wait_ready(f"http://127.0.0.1:{port}/health")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        assert c.get("/").json() == {"message": "AtroposLib API"}
        assert c.get("/health").json()["storage"] == url
        assert c.get("/status").json()["max_staleness"] == 3
        assert c.post("/register", json=_registration()).status_code == 200
        assert c.get("/info").json()["batch_size"] == 8
    assert (tmp_path / "uv.db").exists() == (storage == "sqlite")


def test_rollhub_serve_reload_serves_and_stops_with_its_child(launch: type[Command], tmp_path: Path) -> None:
    """``rollhub serve --reload``: uvicorn's reloader serves from a child process; stopping the group ends both."""
    port = free_port()
    server = launch(
        [str(BIN / "rollhub"), "serve", "--reload", "--port", str(port), "--storage", "memory", "--max-staleness", "2"],
        cwd=workdir(tmp_path),
    )
    server.wait_ready(f"http://127.0.0.1:{port}/health")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        assert c.get("/health").json()["storage"] == "memory"
        status = c.get("/status")
        assert status.status_code == 200 and status.json()["max_staleness"] == 2
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children, "--reload serves from a child of the reloader"
    server.stop()
    assert server.proc.returncode is not None and not server.group_alive()
    assert not [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param([str(BIN / "rollhub"), "serve", "--host", "127.0.0.1"], id="rollhub-serve-default-sqlite"),
        pytest.param([sys.executable, "-m", "rollhub", "serve", "--storage", "memory"], id="python-m-rollhub-serve"),
    ],
)
def test_rollhub_serve(launch: type[Command], tmp_path: Path, argv: list[str]) -> None:
    """``rollhub serve`` keeps sqlite:///rollhub.db in the current directory; ``python -m rollhub serve`` too."""
    port = free_port()
    cwd = workdir(tmp_path)
    launch([*argv, "--port", str(port)], cwd=cwd).wait_ready(f"http://127.0.0.1:{port}/health")
    health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
    if "--storage" in argv:
        assert health == {"status": "ok", "storage": "memory", "durable": False, "step": 0}
    else:
        assert health["storage"] == "sqlite:///rollhub.db" and health["durable"] is True
        assert (cwd / "rollhub.db").exists()


def test_run_api_takes_atroposlibs_flags_and_an_api_key(launch: type[Command], tmp_path: Path) -> None:
    """``.venv/bin/run-api --host 127.0.0.1 --port P --api-key KEY`` is rollhub, and its routes need the key."""
    port = free_port()
    argv = [str(BIN / "run-api"), "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY]
    launch(argv, cwd=workdir(tmp_path)).wait_ready(f"http://127.0.0.1:{port}/health")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        assert c.get("/status").status_code == 401
        assert c.post("/register", json=_registration()).status_code == 401
        assert c.get("/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.post("/register", json=_registration(), headers=auth).status_code == 200
        assert c.get("/status", headers=auth).json()["current_step"] == 0
        assert c.get("/dashboard").status_code == 200  # the page (no data) loads so its key box can be used


def test_run_api_in_the_venv_is_rollhubs() -> None:
    """The reference atroposlib owns no console script in the venv: ``run-api`` is rollhub's, with --api-key."""
    done = run(str(BIN / "run-api"), "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: run-api") and "--api-key" in done.stdout and "--storage" in done.stdout


def test_reference_atroposlib_is_importable() -> None:
    """The compatibility tests compare against the published 0.4.0; ``make setup`` installs it, so it is here."""
    from importlib.metadata import version

    import atroposlib

    assert version("atroposlib") == "0.4.0"
    if REFERENCE_DIR.is_dir():  # where make setup puts it; ahead of anything else on the path
        assert Path(atroposlib.__file__).is_relative_to(REFERENCE_DIR)


# ---------------------------------------------------------------- help


def test_rollhub_help_lists_the_commands() -> None:
    done = run(str(BIN / "rollhub"), "--help")
    assert done.returncode == 0, done.stderr
    commands = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")]
    assert commands == ["serve", "run-api", "run", "gateway", "demo"]
    assert f"default {DEFAULT_DEMO}" in done.stdout


def test_rollhub_demo_help_lists_every_demo_and_the_default() -> None:
    done = run(str(BIN / "rollhub"), "demo", "--help")
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    assert list(listed) == list(DEMOS) == ["cartpole", "buffer", "arithmetic", "llm", "tools"]
    assert [name for name, line in listed.items() if "(default)" in line] == [DEFAULT_DEMO] == ["cartpole"]
    assert f"with no NAME, {DEFAULT_DEMO} runs" in done.stdout


def test_rollhub_demo_without_a_name_runs_the_default() -> None:
    """An option the default demo does not know reaches the default demo's own parser (nothing is run)."""
    done = run(str(BIN / "rollhub"), "demo", "--no-such-option")
    assert done.returncode == 2
    assert f"usage: rollhub demo {DEFAULT_DEMO}" in done.stderr and "--no-such-option" in done.stderr


@pytest.mark.parametrize("name", list(DEMOS))
def test_every_demo_has_help(name: str) -> None:
    done = run(str(BIN / "rollhub"), "demo", name, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: rollhub demo {name}")


def test_rollhub_run_help() -> None:
    done = run(str(BIN / "rollhub"), "run", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: rollhub run")
    assert all(flag in done.stdout for flag in ("--set", "--print-config", "--resume", "--overwrite"))


def test_rollhub_run_prints_the_shipped_cartpole_config() -> None:
    """``rollhub run --print-config`` on the config the cartpole demo runs (shipped in the package)."""
    from importlib import resources

    path = resources.files("rollhub.run.configs").joinpath("cartpole.toml")
    done = run(str(BIN / "rollhub"), "run", "--print-config", str(path), "--set", "fleet.workers=3")
    assert done.returncode == 0, done.stderr
    assert '[env]\nkind = "step"\nid = "CartPole-v1"' in done.stdout and "workers = 3" in done.stdout


def test_rollhub_serve_help() -> None:
    done = run(str(BIN / "rollhub"), "serve", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: rollhub serve") and "--reload" in done.stdout


# ---------------------------------------------------------------- documented examples


def test_documented_toy_trainer_and_toy_handler(launch: type[Command], tmp_path: Path) -> None:
    """docs/clients.md, the toy scripts, bounded: a trainer of 2 steps and a handler of 4 groups."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = launch([str(BIN / "rollhub"), "serve", "--storage", "memory", "--port", str(port)], cwd=workdir(tmp_path))
    server.wait_ready(url + "/health")
    trainer = launch([sys.executable, "examples/toy_trainer.py", "--steps", "2", "--server-url", url])
    handler = launch([sys.executable, "examples/toy_handler.py", "--groups", "4", "--server-url", url])
    for command in (handler, trainer):
        try:
            command.proc.wait(READY_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{command.argv} did not finish within {READY_S} s:\n{command.output()}")
        assert command.proc.returncode == 0, command.output()
    assert "toy_addition_0: sent 4 groups (16 sequences)" in handler.output()
    assert "step 2: 2 groups, 8 sequences" in trainer.output()


def _registration() -> dict[str, object]:
    return registration_body(8, num_steps=10)
