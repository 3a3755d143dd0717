"""A run killed with SIGKILL after a checkpoint resumes from its run directory and continues its counts."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from tests.run.run_process import CORRIDOR, REPO, kill_tree, rollhub_run, rows, start_run, summary_of

ECHO = REPO / "tests" / "run" / "echo_digit.toml"

# A target it cannot reach, so the run lasts until it is killed; a checkpoint every 2 updates.
FIRST = ["--set", "run.target_return=100.0", "--set", "run.checkpoint_every=2", "--set", "run.max_updates=100000"]


def wait_for_checkpoint(latest: Path, proc, log: Path, deadline_s: float = 240.0) -> None:
    """Wait until the run has written its ``LATEST`` checkpoint marker (fails if it exits first)."""
    deadline = time.monotonic() + deadline_s
    while not latest.exists():
        if proc.poll() is not None:
            pytest.fail(f"the run exited with {proc.returncode} before a checkpoint:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no checkpoint within {deadline_s} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@pytest.mark.ray
def test_sigkilled_run_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    log = tmp_path / "first.log"
    proc = start_run(str(CORRIDOR), "--set", f"run.dir={str(run_dir)!r}", *FIRST, log=log)
    try:
        wait_for_checkpoint(run_dir / "checkpoints" / "LATEST", proc, log)
    finally:
        kill_tree(proc)
    checkpointed = int((run_dir / "checkpoints" / "LATEST").read_text())
    assert checkpointed >= 2 and checkpointed % 2 == 0
    before = rows(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    assert [r["version"] for r in before][:checkpointed] == list(range(1, checkpointed + 1))

    stop_at = checkpointed + 6
    done = rollhub_run("--resume", str(run_dir), "--set", f"run.max_updates={stop_at}")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]  # the update limit, not the target
    summary = summary_of(done)
    assert summary["stop_reason"] == "update limit" and summary["policy_version"] == stop_at >= checkpointed

    metrics = rows(run_dir / "metrics.jsonl")
    assert [r["version"] for r in metrics] == list(range(1, stop_at + 1))  # continues, no restart at 0, no repeat
    steps = [r["trained_steps"] for r in metrics]
    assert steps == sorted(steps) and steps[checkpointed] > steps[checkpointed - 1] > 0
    assert metrics[checkpointed - 1] == before[checkpointed - 1]  # rows up to the checkpoint are kept as they were
    episodes = rows(run_dir / "episodes.jsonl")
    assert [e["index"] for e in episodes] == list(range(len(episodes))) and summary["episodes"] == len(episodes)
    assert all(a["env_steps"] < b["env_steps"] for a, b in itertools.pairwise(episodes))
    assert "max_updates = " + str(stop_at) in (run_dir / "config.toml").read_text()


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(CORRIDOR.read_text())
    done = rollhub_run("--resume", str(tmp_path))
    assert done.returncode == 2
    assert "holds no checkpoint to resume from" in done.stderr and "Traceback" not in done.stderr


def test_a_sigkilled_group_run_resumes_its_trainer_and_curriculum(tmp_path: Path) -> None:
    from rollhub.run.rundir import RunDirectory

    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    endless = ["--set", "eval.target_accuracy=1.1", "--set", "run.checkpoint_every=5"]
    endless += ["--set", "run.max_updates=100000"]
    proc = start_run(str(ECHO), "--set", f"run.dir={str(run_dir)!r}", *endless, log=log)
    try:
        wait_for_checkpoint(run_dir / "checkpoints" / "LATEST", proc, log)
    finally:
        kill_tree(proc)
    saved = RunDirectory(run_dir).checkpoints.load_latest()
    checkpointed = saved.metadata["trainer"]["version"]
    samples = saved.metadata["curriculum"]["lessons"]["main"]["n_samples"]
    assert checkpointed >= 5 and checkpointed % 5 == 0 and samples > 0

    stop_at = checkpointed + 10
    done = rollhub_run("--resume", str(run_dir), "--set", f"run.max_updates={stop_at}")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]  # the update limit, not the target
    assert summary_of(done)["steps"] == stop_at
    assert [r["version"] for r in rows(run_dir / "metrics.jsonl")] == list(range(1, stop_at + 1))
    resumed = RunDirectory(run_dir).checkpoints.load_latest()
    assert resumed.metadata["trainer"]["version"] == stop_at and resumed.metadata["sessions"] == 2
    assert resumed.metadata["curriculum"]["lessons"]["main"]["n_samples"] > samples  # it went on from the saved one
