"""A run's engine SIGKILLed mid-run (a real vLLM engine the run started): the supervisor restarts it on its port
with the newest pushed weights, sampling resumes, and the run reaches its target."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import psutil
import pytest

pytest.importorskip("transformers")

from rollhub.inference.engine import SERVE_MODULE
from rollhub.run.config import load_config
from rollhub.run.main import execute

pytestmark = pytest.mark.vllm


def _engine_pid(model_dir: Path) -> int | None:
    """The pid of this process's vLLM API server for ``model_dir`` (its own process group), if running."""
    for child in psutil.Process().children(recursive=True):
        try:
            line = child.cmdline()
        except psutil.Error:
            continue
        if SERVE_MODULE in line and str(model_dir) in line:
            return child.pid
    return None


@pytest.mark.timeout(1200)  # two engine starts, which on a loaded 2-core machine take minutes each
def test_a_killed_engine_is_restarted_with_the_newest_weights_and_the_run_reaches_its_target(
    tmp_path: Path, vllm_python: str
) -> None:
    run = tmp_path / "run"
    config = load_config({
        "run": {"name": "supervised", "dir": str(run), "max_updates": 8, "progress": False},
        "env": {"kind": "group", "id": "mock", "kwargs": {"max_tokens": 3}, "group_size": 4},
        "policy": {"kind": "hf", "max_len": 128},
        "inference": {"python": vllm_python, "probe_every": 1, "max_restarts": 2},
        "trainer": {"groups_per_batch": 4},
        "eval": {"every": 100, "n_examples": 4},
    })  # fmt: skip
    killed: dict[str, int] = {}
    done = threading.Event()

    def kill_after_three_updates() -> None:
        metrics = run / "metrics.jsonl"
        while not done.wait(0.2):
            rows = metrics.read_text().splitlines() if metrics.exists() else []
            pid = _engine_pid(run / "model")
            if len(rows) >= 3 and pid is not None:
                killed["version"] = json.loads(rows[-1])["version"]
                killed["pid"] = pid
                os.killpg(pid, signal.SIGKILL)
                return

    killer = threading.Thread(target=kill_after_three_updates, daemon=True)
    killer.start()
    try:
        assert execute(config) == 0
    finally:
        done.set()
        killer.join(60)
    assert killed, "the engine was never killed"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["engine_restarts"] == 1
    died, back = summary["engine_events"]
    assert "engine 0 died" in died and "exited with code -9" in died
    back_version = int(back.rsplit(" ", 1)[1])
    assert back_version >= killed["version"]  # reloaded with the newest version pushed, not the initial weights
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == list(range(1, 9))
    after = [r for r in rows if r["version"] > back_version and "probe_mismatch_abs" in r]
    assert after and all(r["probe_mismatch_abs"] < 1e-3 for r in after)  # the engine holds the trainer's weights
    assert _engine_pid(run / "model") is None  # the restarted engine was stopped with the run
