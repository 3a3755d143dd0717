"""End to end: rollhub serve + a Ray fleet of group workers + GRPO pulling through TrainerClient, as
``rollhub demo arithmetic`` (the ``server`` writer of ``rollhub run``) runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollhub.demos.arithmetic import main

pytestmark = pytest.mark.ray


def test_distributed_grpo_raises_the_training_reward(
    ray_session: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Single-digit addition, small batches: the mean training reward (partial credit per digit) climbs
    well above its start within 60 trainer steps; every trained group was within the staleness bound."""
    argv = ["--max-steps", "60", "--target", "1.1", "--n-prompts", "16", "--group-size", "8", "--lr", "3e-3"]
    argv += ["--eval-every", "30", "--max-operand", "9", "--workers", "1", "--max-staleness", "2"]
    argv += ["--checkpoint-every", "0", "--max-seconds", "240", "--out-dir", str(tmp_path), "--no-progress"]
    assert main(argv) == 1  # the target 1.1 cannot be reached
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 60
    assert summary["initial_eval_accuracy"] < 0.2
    assert summary["train_reward_last10"] > summary["train_reward_first10"] + 0.1
    assert summary["max_group_staleness"] <= 2 and summary["trainer_stale_groups"] == 0
    assert summary["worker_restarts"] == [0] and summary["batches_skipped"] == 0
    # admission control: the worker waited for the trainer instead of sampling what the server would drop
    dropped = sum((summary["server_stale_dropped"] or {}).values())
    assert summary["admission_waits"] > 0 and dropped <= 0.01 * summary["groups_written"], json.dumps(summary)
    assert [s for s, _ in summary["curve"]] == [0, 30, 60]
    assert (tmp_path / "arithmetic_learning_curve.png").stat().st_size > 1000
    lines = [json.loads(line) for line in (tmp_path / "w0.jsonl").read_text().splitlines()]
    assert lines[0]["event"] == "init" and lines[-1]["event"] == "finish"  # the worker logged and was stopped
    versions = [line["policy_version"] for line in lines[1:-1]]
    assert versions == sorted(versions) and versions[-1] >= 50  # weights reached the worker all along
