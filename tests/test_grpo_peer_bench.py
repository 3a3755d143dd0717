"""The pure pieces of ``benchmarks/grpo_peer.py`` and its TRL side (``grpo_peer_trl.py``, loaded without TRL):
the exported task against the arithmetic environment, the TRL side's reward against the environment's, the
figures read from a run's files, and the medians, ratios and table."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from rollhub.envs.group.arithmetic import ArithmeticEnv
from rollhub.inference.base import Completion

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


peer = _load("grpo_peer")
peer_trl = _load("grpo_peer_trl")


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
    assert s["not_matched"]["entropy_coef"] == 0.2
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
        "trl": [_run(1000, 534.0), _run(900, 500.0), _run(None, None, 0.6)],
        "rollhub_in_process": [_run(875, 795.0), _run(800, 400.0), _run(700, 300.0)],
        "rollhub_distributed": [_run(None, None, 0.5), _run(None, None, 0.2), _run(950, 1600.0)],
    }
    s = peer.summarize(results, 0.9)
    assert s["medians"]["trl"] == {"updates": 1000, "wall_s": 534.0}
    assert s["medians"]["rollhub_in_process"] == {"updates": 800, "wall_s": 400.0}
    assert s["medians"]["rollhub_distributed"] == {"updates": None, "wall_s": None}
    r = s["ratios"]["rollhub_in_process"]
    assert r["wall_s_per_seed"] == pytest.approx([795 / 534, 0.8, 0.0])
    assert r["wall_s_median"] == pytest.approx(400 / 534)
    assert s["goal_met"] == {"rollhub_in_process": True, "rollhub_distributed": False}
    assert s["ratios"]["rollhub_distributed"]["wall_s_median"] == math.inf
    text = peer.table(results, [0, 1, 2], 0.9)
    lines = text.splitlines()
    assert "updates to 0.9" in lines[0] and "wall s to 0.9" in lines[0]
    assert any(line.split()[:4] == ["0", "rollhub_in_process", "875", "795.0"] and "1.49, 0.88" in line
               for line in lines)  # fmt: skip
    assert any("not reached" in line and "final accuracy 0.600 after 900 updates, 2400.0 s" in line for line in lines)
    assert "goal (rollhub_in_process median wall s to 0.9 <= TRL's): met" in text
    assert "goal (rollhub_distributed median wall s to 0.9 <= TRL's): NOT met" in text
    assert json.loads(json.dumps(peer.jsonable(s)))["ratios"]["rollhub_distributed"]["wall_s_median"] == "inf"


def test_a_failed_run_shows_as_failed() -> None:
    results = {"trl": [_run(10, 5.0)], "rollhub_in_process": [peer.failed("no summary (exit 1)", 3.0)]}
    text = peer.table(results, [0], 0.9)
    assert "failed" in text and "no summary (exit 1)" in text
