"""The pure pieces of ``benchmarks/grpo_peer.py`` and its TRL side (``grpo_peer_trl.py``, loaded without TRL):
the exported task against the arithmetic environment, the TRL side's reward against the environment's, the
figures read from a run's files, and the medians, ratios and table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rollhub.envs.group.arithmetic import ArithmeticEnv
from rollhub.inference.base import Completion
from tests.script_modules import BENCHMARKS, load_benchmark

peer = load_benchmark("grpo_peer")
peer_trl = load_benchmark("grpo_peer_trl")


def test_the_trl_side_imports_no_trl_and_no_rollhub() -> None:
    text = (BENCHMARKS / "grpo_peer_trl.py").read_text()
    assert "rollhub" not in "".join(line for line in text.splitlines() if line.lstrip().startswith(("import", "from")))
    top = [line for line in text.splitlines() if line.startswith(("import", "from"))]
    assert not any("trl" in line or "torch" in line or "transformers" in line for line in top)


def test_task_export_is_the_environments_split_and_the_configs_settings() -> None:
    config = peer.load_llm_config()
    task = peer.task_export(config)
    env = ArithmeticEnv(**config.env.kwargs)
    assert task["train"] == [[env.prompt(a, b), env.answer(a, b)] for a, b in env.train_problems]
    assert task["eval"] == [[env.prompt(a, b), env.answer(a, b)] for a, b in env.eval_problems]
    assert not {p for p, _ in task["train"]} & {p for p, _ in task["eval"]}
    assert task["train"][0] == ["00+00=", "00"]
    s = task["settings"]
    assert (s["group_size"], s["groups_per_batch"]) == (16, 32)
    assert (s["temperature"], s["max_tokens"]) == (1.0, 3)
    assert (s["lr"], s["lr_final"], s["anneal_steps"]) == (1e-3, 1e-4, 3000)
    assert (s["eval_every"], s["target"], s["max_updates"]) == (25, 0.9, 3000)
    assert (s["entropy_coef"], s["entropy_coef_final"], s["entropy_anneal_steps"]) == (0.2, 0.2, 3000)
    assert "entropy_coef" not in s["not_matched"]
    json.dumps(task)  # the TRL side reads it as JSON


def test_task_export_follows_overrides_and_refuses_what_trl_cannot_take() -> None:
    task = peer.task_export(peer.load_llm_config([*peer.QUICK_SETS, "eval.n_examples=7", "sampling.temperature=0.7"]))
    assert len(task["eval"]) == 7
    assert (task["settings"]["max_updates"], task["settings"]["eval_every"]) == (4, 2)
    assert task["settings"]["temperature"] == 0.7
    with pytest.raises(peer.PeerError, match="sampling"):
        peer.task_export(peer.load_llm_config(["sampling.top_p=0.9"]))
    with pytest.raises(peer.PeerError, match=r"run\.max_updates"):
        peer.task_export(peer.load_llm_config(["run.max_updates=4000"]))
    constant = peer.task_export(peer.load_llm_config(["trainer.anneal_steps=0", "run.max_updates=4000"]))
    assert (constant["settings"]["lr_final"], constant["settings"]["anneal_steps"]) == (1e-3, 0)
    assert (constant["settings"]["entropy_coef_final"], constant["settings"]["entropy_anneal_steps"]) == (0.2, 0)
    with pytest.raises(peer.PeerError, match=r"trainer\.entropy_coef"):
        peer.task_export(peer.load_llm_config(["trainer.entropy_coef=0.0", "trainer.entropy_coef_final=0.1"]))


def test_the_trl_sides_entropy_weight_follows_rollhubs_schedule() -> None:
    from rollhub.train.grpo import GRPOConfig

    rollhub = GRPOConfig(entropy_coef=0.2, entropy_coef_final=0.05, anneal_steps=100)
    for step in (0, 1, 37, 50, 99, 100, 250):
        assert peer_trl.annealed(0.2, 0.05, 100, step) == pytest.approx(rollhub.annealed(0.2, 0.05, step))
    assert peer_trl.annealed(0.2, 0.05, 0, 40) == 0.2


@pytest.mark.parametrize(
    ("text", "finish", "answer"),
    [("42", "stop", "42"), ("42", "length", "42"), ("4", "stop", "42"), ("43", "stop", "42"), ("", "stop", "42"),
     ("420", "length", "42"), ("02", "stop", "12"), ("x2", "length", "12"), ("07", "stop", "07")],
)  # fmt: skip
def test_the_trl_reward_is_the_environments(text: str, finish: str, answer: str) -> None:
    env = ArithmeticEnv()
    completion = Completion(prompt_tokens=(), tokens=(), logprobs=(), text=text, finish_reason=finish)
    assert peer_trl.score(text, finish == "stop", answer) == env.score(completion, answer)


def test_figures_of_a_run_that_reached_the_target_and_of_one_that_did_not() -> None:
    rows = [{"version": 25, "eval_accuracy": 0.4, "elapsed_s": 30.0}, {"version": 50, "eval_accuracy": 0.91,
            "elapsed_s": 61.5}]  # fmt: skip
    summary = {"target_reached_at_step": 50, "eval_accuracy": 0.91, "steps": 50, "wall_s": 63.0}
    f = peer.figures(summary, rows, 70.04)
    assert (f["reached"], f["updates"], f["wall_s"], f["run_wall_s"], f["command_s"]) == (True, 50, 61.5, 63.0, 70.0)
    short = peer.figures({"target_reached_at_step": None, "eval_accuracy": 0.4, "steps": 30, "wall_s": 40.0}, rows, 1)
    assert (short["reached"], short["updates"], short["wall_s"], short["final_accuracy"]) == (False, None, None, 0.4)
    assert peer_trl.first_at_target(rows, 0.9) == rows[1]
    assert peer_trl.first_at_target(rows, 0.95) is None


def test_read_rows(tmp_path: Path) -> None:
    assert peer.read_rows(tmp_path / "missing.jsonl") == []
    (tmp_path / "m.jsonl").write_text('{"version": 1}\n\n{"version": 2}\n')
    assert peer.read_rows(tmp_path / "m.jsonl") == [{"version": 1}, {"version": 2}]


def _run(updates: int | None, wall: float | None, final: float = 0.95) -> dict:
    return {"reached": updates is not None, "updates": updates, "wall_s": wall, "final_accuracy": final,
            "steps": updates or 900, "run_wall_s": wall or 2400.0, "command_s": 1.0}  # fmt: skip


def test_medians_count_a_run_not_reached_as_the_slowest() -> None:
    assert peer.median([3.0, None, 1.0]) == 3.0
    assert peer.median([None, None, 1.0]) is None
    assert peer.median([2.0, 4.0]) == 3.0
    assert peer.median([2.0, None]) is None


def test_ratios() -> None:
    assert peer.ratio(50.0, 100.0) == 0.5
    assert peer.ratio(None, 100.0) == math.inf
    assert peer.ratio(50.0, None) == 0.0
    assert peer.ratio(None, None) is None


def test_summary_and_table() -> None:
    results = {
        "trl": {0: _run(1000, 534.0), 1: _run(900, 500.0), 2: _run(None, None, 0.6)},
        "rollhub_in_process": {0: _run(875, 795.0), 1: _run(800, 400.0), 2: _run(700, 300.0)},
        "rollhub_distributed": {0: _run(None, None, 0.5), 1: _run(None, None, 0.2), 2: _run(950, 1600.0)},
    }
    s = peer.summarize(results, 0.9)
    assert s["medians"]["trl"] == {"seeds": [0, 1, 2], "updates": 1000, "wall_s": 534.0}
    assert s["medians"]["rollhub_in_process"] == {"seeds": [0, 1, 2], "updates": 800, "wall_s": 400.0}
    assert s["medians"]["rollhub_distributed"] == {"seeds": [0, 1, 2], "updates": None, "wall_s": None}
    r = s["ratios"]["rollhub_in_process"]
    assert r["seeds"] == [0, 1, 2]
    assert r["wall_s_per_seed"] == pytest.approx([795 / 534, 0.8, 0.0])
    assert r["wall_s_median"] == pytest.approx(400 / 534)
    assert s["goal_met"] == {"rollhub_in_process": True, "rollhub_distributed": False}
    assert s["ratios"]["rollhub_distributed"]["wall_s_median"] == math.inf
    text = peer.table(results, 0.9)
    lines = text.splitlines()
    assert "updates to 0.9" in lines[0] and "wall s to 0.9" in lines[0]
    assert any(line.split()[:4] == ["0", "rollhub_in_process", "875", "795.0"] and "1.49, 0.88" in line
               for line in lines)  # fmt: skip
    assert any("not reached" in line and "final accuracy 0.600 after 900 updates, 2400.0 s" in line for line in lines)
    assert "goal (rollhub_in_process median wall s to 0.9 <= TRL's): met" in text
    assert "goal (rollhub_distributed median wall s to 0.9 <= TRL's): NOT met" in text
    assert json.loads(json.dumps(peer.jsonable(s)))["ratios"]["rollhub_distributed"]["wall_s_median"] == "inf"


def test_seeds_run_apart_pair_only_where_both_ran() -> None:
    """Runs made a few seeds at a time: ratios per seed pair a rollhub run with TRL's of the same seed, medians
    are over the seeds each variant has."""
    results = {"trl": {1: _run(600, 300.0), 2: _run(None, None, 0.1)},
               "rollhub_distributed": {0: _run(500, 400.0), 1: _run(450, 270.0)}}  # fmt: skip
    s = peer.summarize(results, 0.9)
    r = s["ratios"]["rollhub_distributed"]
    assert r["seeds"] == [1] and r["wall_s_per_seed"] == pytest.approx([0.9])
    assert s["medians"]["trl"] == {"seeds": [1, 2], "updates": None, "wall_s": None}
    assert s["medians"]["rollhub_distributed"]["wall_s"] == pytest.approx(335.0)
    assert s["goal_met"] == {"rollhub_distributed": True}  # TRL's median run did not reach the target
    lines = peer.table(results, 0.9).splitlines()
    seed0 = next(line for line in lines if line.split()[:2] == ["0", "rollhub_distributed"])
    assert seed0.split()[2:] == ["500", "400.0"]  # no TRL run of seed 0 to compare with
    assert any(line.split()[:2] == ["1", "rollhub_distributed"] and "0.90, 0.75" in line for line in lines)
    assert any(line.startswith("median  trl") and line.endswith("of 2 seeds") for line in lines)


def test_a_failed_run_shows_as_failed_with_how_far_it_got() -> None:
    results = {"trl": {0: _run(10, 5.0)}, "rollhub_in_process": {0: peer.failed("no summary (exit 1)", 3.0)}}
    text = peer.table(results, 0.9)
    assert "failed" in text and "no summary (exit 1)" in text and "last evaluation" not in text
    rows = [{"version": 25, "eval_accuracy": 0.25, "elapsed_s": 20.0}, {"version": 26, "elapsed_s": 21.0},
            {"version": 50, "eval_accuracy": 0.5, "elapsed_s": 40.5}, {"version": 51, "elapsed_s": 41.0}]  # fmt: skip
    f = peer.failed("no summary (exit -9)", None, rows)
    assert (f["reached"], f["final_accuracy"], f["steps"], f["run_wall_s"], f["command_s"]) == (False, 0.5, 50, 40.5,
                                                                                                None)  # fmt: skip
    assert "no summary (exit -9); last evaluation 0.500 at update 50, 40.5 s" in peer.table({"trl": {3: f}}, 0.9)
    assert peer.median([f["wall_s"], 10.0, 20.0]) == 20.0  # failed counts as not reached


def _leave_run(work: Path, variant: str, seed: int, summary: dict | None, rows: list[dict]) -> None:
    out = peer.run_dir(work, variant, seed)
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (out / peer.summary_name(variant)).write_text(json.dumps(summary))


def test_the_table_of_runs_left_in_work_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--table`` reads the runs earlier benchmarks left (one directory per variant and seed), a later work
    directory's run replacing an earlier one's, a run without a summary counting as failed."""
    first, second = tmp_path / "first", tmp_path / "second"
    reached = {"target_reached_at_step": 50, "eval_accuracy": 0.92, "steps": 50, "wall_s": 70.0}
    rows = [{"version": 25, "eval_accuracy": 0.3, "elapsed_s": 30.0}, {"version": 50, "eval_accuracy": 0.92,
            "elapsed_s": 60.0}]  # fmt: skip
    _leave_run(first, "trl", 0, None, rows[:1])  # stopped before its summary
    _leave_run(first, "rollhub_distributed", 0, reached, rows)
    _leave_run(first, "rollhub_distributed", 1, None, [])
    _leave_run(second, "rollhub_distributed", 1, {**reached, "target_reached_at_step": 25}, rows)
    (first / "model-s0").mkdir()
    (first / "trl-sx").mkdir()  # not a run directory
    found = peer.read_work_dir(first)
    assert set(found) == {"trl", "rollhub_distributed"} and sorted(found["rollhub_distributed"]) == [0, 1]
    assert found["trl"][0]["error"] == f"no summary in {first / 'trl-s0'}" and found["trl"][0]["steps"] == 25
    assert found["rollhub_distributed"][0] == {"reached": True, "updates": 50, "wall_s": 60.0, "final_accuracy": 0.92,
                                               "steps": 50, "run_wall_s": 70.0, "command_s": None}  # fmt: skip
    assert peer.main(["--table", str(first), str(second), "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    report = json.loads(out[-1])
    assert report["runs"]["rollhub_distributed"]["1"]["wall_s"] == 30.0  # the second directory's run
    assert report["runs"]["trl"]["0"]["reached"] is False
    assert report["ratios"]["rollhub_distributed"]["wall_s_per_seed"] == [0.0]  # only rollhub reached on seed 0
    assert report["work_dirs"] == [str(first), str(second)]
    assert peer.main(["--table", str(tmp_path / "missing")]) == 2
    assert "missing: not a directory" in capsys.readouterr().err
    assert peer.main(["--table", str(first / "model-s0")]) == 2
    assert "no runs" in capsys.readouterr().err


def test_seeds_given_one_by_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert peer.parse_args(["--seed", "2", "--seed", "1"]).seed_list == [2, 1]
    assert peer.parse_args([]).seed_list is None
    assert peer.main(["--seed", "-1"]) == 2
    assert "every --seed >= 0" in capsys.readouterr().err
