"""``rollhub run`` as a subprocess, the way a user types it, with the repository on the import path (so
environments defined in test modules, e.g. ``tests.run.corridor:Corridor``, load in every process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
CORRIDOR = REPO / "tests" / "run" / "corridor.toml"


def run_env() -> dict[str, str]:
    """The environment of a ``rollhub run`` child: the repository root added to ``PYTHONPATH``."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(REPO)])}


def rollhub_run(*args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m rollhub run ARGS`` to completion from the repository root."""
    cmd = [sys.executable, "-m", "rollhub", "run", *args]
    return subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=timeout_s)


def start_run(*args: str, log: Path) -> subprocess.Popen[bytes]:
    """Start ``python -m rollhub run ARGS`` in a session of its own, output to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rollhub", "run", *args],
            cwd=REPO,
            env=run_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process, every descendant it started (Ray's included) and its process group."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for process in tree:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    psutil.wait_procs(tree, timeout=30)


def summary_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON summary a run prints as its last line."""
    return json.loads(done.stdout.strip().splitlines()[-1])


def rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path``."""
    return [json.loads(line) for line in path.read_text().splitlines()]
