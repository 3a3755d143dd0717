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
