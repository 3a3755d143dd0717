"""Shared fixtures: free loopback ports and `rollhub serve` subprocesses that tests start and stop.

The published AtroposLib 0.4.0 (the reference the compatibility tests compare against) is installed by
``make setup`` into ``.venv/reference`` rather than into the venv itself, so its own ``run-api`` console script
never replaces rollhub's in ``.venv/bin``. This module puts that directory on the import path of the tests and,
through ``PYTHONPATH``, of every child process they start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollhub.run.child_server import ChildServer, free_port, rollhub_command

# Ray lowers its worker processes to niceness 15 by default, so on a machine whose cores other work keeps busy
# (as CI's are) every actor, environment process and demo fleet would get a few percent of a core and the Ray tests
# would wait on starved workers. The tests and the processes they start run Ray's workers at the normal priority.
os.environ.setdefault("RAY_worker_niceness", "0")

REFERENCE_DIR = Path(sys.prefix) / "reference"


def use_reference_package(directory: Path = REFERENCE_DIR) -> None:
    """Make ``atroposlib`` importable from ``directory`` here and in child processes (no-op if it is absent)."""
    if not directory.is_dir():
        return
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(directory) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, str(directory)])


use_reference_package()


__all__ = ["REFERENCE_DIR", "ServerProcess", "free_port", "use_reference_package"]


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


def registration_body(
    batch_size: int = 8, *, starting_step: int = 0, num_steps: int = 100, checkpoint_dir: str = "/tmp"
) -> dict[str, object]:
    """A ``POST /register`` body as an Atropos trainer sends it (W&B names, 64-token sequences)."""
    return {
        "wandb_group": "g",
        "wandb_project": "p",
        "batch_size": batch_size,
        "max_token_len": 64,
        "checkpoint_dir": checkpoint_dir,
        "save_checkpoint_interval": 1,
        "starting_step": starting_step,
        "num_steps": num_steps,
    }


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns these marks into the groups it schedules
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (``make test``), every test of a file runs on one worker, so its module
    fixtures are made once, and every test that starts a real vLLM engine runs on one worker, in file order, so the
    session's shared engine is started once and two engines never starve each other."""
    for item in items:
        group = "vllm" if item.get_closest_marker("vllm") else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
