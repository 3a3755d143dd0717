"""``rollhub run`` on a config naming an environment defined in a test module learns something measurable."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.run.corridor import Corridor
from tests.run.run_process import CORRIDOR, kill_tree, rollhub_run, rows, start_run, summary_of


def random_policy_return(episodes: int = 300, seed: int = 0) -> float:
    """The mean return of uniformly random actions in the corridor of the config (length 5, 30 steps)."""
    rng = np.random.default_rng(seed)
    env, returns = Corridor(length=5, max_steps=30), []
    for _ in range(episodes):
        env.reset()
        total, done = 0.0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(rng.integers(2))
            total += reward
            done = terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


@pytest.mark.ray
def test_run_learns_a_user_defined_environment(tmp_path: Path) -> None:
    baseline = random_policy_return()
    best = 1 - 4 * 0.1
    assert baseline < 0.0  # a random walk mostly runs out of time
    done = rollhub_run(str(CORRIDOR), "--set", f"run.dir={str(tmp_path / 'run')!r}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = summary_of(done)
    assert summary["stop_reason"] == "target reached" and summary["policy_version"] <= 150
    assert summary["mean_return_last20"] >= 0.45 > baseline + 0.4
    assert summary["mean_return_last20"] <= best + 1e-6
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert max(r["staleness"] for r in metrics) == summary["max_staleness_seen"] <= 1  # the config's bound
    episodes = rows(tmp_path / "run" / "episodes.jsonl")
    assert np.mean([e["return"] for e in episodes[-20:]]) == pytest.approx(summary["mean_return_last20"], abs=0.01)
    assert all(e["task"] == "tests.run.corridor:Corridor" for e in episodes)


def test_the_local_fleet_learns_the_same_environment_without_a_ray_runtime(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    proc = start_run(str(CORRIDOR), "--set", f"run.dir={str(tmp_path / 'run')!r}", "--set", "fleet.backend='local'",
                     log=log)  # fmt: skip
    seen: set[str] = set()
    try:
        while proc.poll() is None:  # every process the run starts, for as long as it runs
            try:
                seen |= {child.name() for child in psutil.Process(proc.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.05)
    finally:
        kill_tree(proc)
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stop_reason"] == "target reached" and summary["mean_return_last20"] >= 0.45
    assert not {name for name in seen if "raylet" in name or "gcs_server" in name or name.startswith("ray::")}
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert max(r["staleness"] for r in metrics) == summary["max_staleness_seen"] <= 1
