"""The warm start of ``benchmarks/partial.py``: supervised steps on training prompts give every mode of a seed the
same starting model, which the run config then names."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import ModuleType

import torch

from rollhub.envs.group.repeat import RepeatEnv
from rollhub.models import load_causal_lm, load_tokenizer
from rollhub.run.config import load_config
from tests.script_modules import load_benchmark


def _answer_loss(partial: ModuleType, model_dir: Path, env: RepeatEnv, prompts: list[str]) -> float:
    with torch.no_grad():
        loss = partial.answer_loss(load_causal_lm(str(model_dir)), load_tokenizer(str(model_dir)), env, prompts)
    return float(loss)


def test_a_warm_start_lowers_the_held_out_loss_and_the_run_config_names_it(tmp_path: Path) -> None:
    partial = load_benchmark("partial")
    setup = partial.Setup(length=8, prompt_digits=4, n_eval=32, pass_share=0.9, groups=4, group_size=2, updates=2,
                          workers=1, max_staleness=2, lr=1e-3, entropy_coef=0.0, max_seconds=60.0,
                          warm_steps=20)  # fmt: skip
    warm = partial.warm_start(setup, 0, tmp_path)
    env = RepeatEnv(length=8, n_eval=32)
    held_out = env.eval_prompts  # never among the prompts the warm start trains on
    before = _answer_loss(partial, tmp_path / "model-s0", env, held_out)  # the model the warm start began from
    assert _answer_loss(partial, warm, env, held_out) < 0.5 * before
    data = tomllib.loads(setup.config("keep", 0, tmp_path / "run", "python", warm))
    config = load_config(data, source="partial's config")
    assert config.policy.model == str(warm) and not config.policy.tiny
    assert load_config(tomllib.loads(setup.config("keep", 0, tmp_path / "run", "python"))).policy.model == "tiny"


def _run(mode: str, seed: int, tokens_per_s: float, pushes: list[float]) -> dict:
    """A run as ``run_one`` reports it, with only what the summary reads."""
    return {
        "mode": mode, "seed": seed, "tokens_per_s": tokens_per_s, "push_wait_mean": sum(pushes) / len(pushes),
        "push_wait_median": sorted(pushes)[len(pushes) // 2], "push_wait_p95": max(pushes),
        "push_wait_max": max(pushes), "batch_wait_median": 0.5, "dropped": 0, "accuracy": 0.5, "reward": 0.5,
        "initial_reward": 0.4, "lag_mean": 1.5, "wall_s": 100.0,
    }  # fmt: skip


def test_the_summary_pairs_runs_by_seed_and_shows_each_modes_longest_push() -> None:
    partial = load_benchmark("partial")
    runs = [_run("wait", 0, 1000.0, [1.0, 1.2, 2.9]), _run("wait", 1, 2000.0, [1.0, 1.0, 1.0]),
            _run("keep", 0, 1500.0, [0.1, 0.1, 0.1]), _run("keep", 1, 2000.0, [0.1, 0.1, 5.1])]  # fmt: skip
    wait, keep = partial.summarize(runs)
    assert (wait["mode"], keep["mode"]) == ("wait", "keep")
    assert keep["throughput_ratio"] == [1.5, 1.0]  # each keep run against its own seed's wait run
    assert keep["push_wait_max"] == 5.1 and wait["push_wait_max"] == 2.9  # the longest over seeds, not a median
    table = partial.runs_table([wait, keep], partial.Setup(length=8, prompt_digits=4, n_eval=8, pass_share=0.9,
                               groups=4, group_size=2, updates=2, workers=1, max_staleness=2, lr=1e-3,
                               entropy_coef=0.0, max_seconds=60.0, warm_steps=0))  # fmt: skip
    assert "/ longest (s)" in table and "/ 5.10 |" in table and "/ 2.90 |" in table
