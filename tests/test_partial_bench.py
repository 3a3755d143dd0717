"""The warm start of ``benchmarks/partial.py``: supervised steps on training prompts give every mode of a seed the
same starting model, which the run config then names."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import torch

from rollhub.envs.group.repeat import RepeatEnv
from rollhub.models import load_causal_lm, load_tokenizer
from rollhub.run.config import load_config

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _partial():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("partial", BENCHMARKS / "partial.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["partial"] = module
    spec.loader.exec_module(module)
    return module


def _answer_loss(model_dir: Path, env: RepeatEnv, prompts: list[str]) -> float:
    tokenizer, model = load_tokenizer(str(model_dir)), load_causal_lm(str(model_dir))
    ids, labels = [], []
    for prompt in prompts:
        asked = tokenizer(prompt)["input_ids"]
        answer = tokenizer(env.answer(prompt), add_special_tokens=False)["input_ids"]
        ids.append(asked + answer)
        labels.append([-100] * len(asked) + answer)
    with torch.no_grad():
        return float(model(input_ids=torch.tensor(ids), labels=torch.tensor(labels)).loss)


def test_a_warm_start_lowers_the_held_out_loss_and_the_run_config_names_it(tmp_path: Path) -> None:
    partial = _partial()
    setup = partial.Setup(length=8, prompt_digits=4, n_eval=32, pass_share=0.9, groups=4, group_size=2, updates=2,
                          workers=1, max_staleness=2, lr=1e-3, entropy_coef=0.0, max_seconds=60.0,
                          warm_steps=20)  # fmt: skip
    warm = partial.warm_start(setup, 0, tmp_path)
    env = RepeatEnv(length=8, n_eval=32)
    held_out = env.eval_prompts  # never among the prompts the warm start trains on
    assert _answer_loss(warm, env, held_out) < 0.5 * _answer_loss(tmp_path / "model-s0", env, held_out)
    data = tomllib.loads(setup.config("keep", 0, tmp_path / "run", "python", warm))
    config = load_config(data, source="partial's config")
    assert config.policy.model == str(warm) and not config.policy.tiny
    assert load_config(tomllib.loads(setup.config("keep", 0, tmp_path / "run", "python"))).policy.model == "tiny"
