from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollhub.demos.arithmetic import ItemQueue, main
from rollhub.envs.group.arithmetic import ArithmeticEnv
from rollhub.inference.tokenizer import CharTokenizer
from rollhub.weights.checkpoint import CheckpointDirectory


def test_item_queue_serves_whole_groups_oldest_first() -> None:
    q = ItemQueue(batch_size=4)
    q.put([{"tokens": [[1], [2]], "id": 0}, {"tokens": [[3]], "id": 1}])
    assert q.next_batch() is None
    q.put([{"tokens": [[4], [5]], "id": 2}])
    assert [it["id"] for it in q.next_batch() or []] == [0, 1, 2]
    assert q.next_batch() is None


def test_short_demo_run_writes_every_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A few steps cannot reach the target, so the exit code is 1; every artifact is still written."""
    summary_path = tmp_path / "summary.json"
    argv = ["--max-steps", "6", "--eval-every", "3", "--n-prompts", "8", "--group-size", "4"]
    code = main(
        [*argv, "--out-dir", str(tmp_path / "out"), "--summary-json", str(summary_path), "--no-progress"]
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert code == 1 and json.loads(summary_path.read_text()) == summary
    assert summary["steps"] == 6 and summary["wall_s"] > 0
    assert [s for s, _ in summary["curve"]] == [0, 3, 6]
    assert summary["initial_eval_accuracy"] == summary["curve"][0][1] < 0.1
    assert 0.0 <= summary["eval_accuracy"] <= 1.0
    out = tmp_path / "out"
    assert (out / "learning_curve.png").stat().st_size > 1000
    assert len((out / "eval_rollouts.jsonl").read_text().splitlines()) == 3  # one per evaluation
    assert CheckpointDirectory(out / "checkpoints").latest_step() == 6


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ROLLHUB_SLOW"), reason="about 3-4 CPU minutes; set ROLLHUB_SLOW=1")
def test_full_demo_learns_addition(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole run: evaluation accuracy climbs from 0 to at least 90% by GRPO alone."""
    code = main(["--out-dir", str(tmp_path), "--no-progress", "--target", "0.9"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["initial_eval_accuracy"] == 0.0 and summary["eval_accuracy"] >= 0.9
    accuracies = [a for _, a in summary["curve"]]
    assert max(accuracies[: len(accuracies) // 2]) < 0.9  # it climbed; it did not start there


def test_two_digit_task_evaluates_on_held_out_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--digits", "2", "--max-steps", "2", "--eval-every", "2", "--n-prompts", "4", "--group-size", "2"]
    assert main([*argv, "--out-dir", str(tmp_path), "--no-progress"]) == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["eval_problems"] == "200 held-out problems" and summary["steps"] == 2
    record = json.loads((tmp_path / "eval_rollouts.jsonl").read_text().splitlines()[0])
    tok = CharTokenizer()
    prompts = {tok.decode(item["tokens"][0][: item["masks"][0].count(-100)]) for item in record["items"]}
    env = ArithmeticEnv(max_operand=99, width=3, pad_operands=True, holdout_fraction=0.05)
    held_out = {env.prompt(a, b) for a, b in env.eval_problems}
    assert len(record["items"]) == 200 and len(prompts) == 200 and prompts <= held_out
