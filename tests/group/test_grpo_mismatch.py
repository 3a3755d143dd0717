"""The GRPO trainer against an inference engine: the train-inference mismatch it reports, the warning it logs,
the truncated importance ratio, and a step on a Hugging Face causal LM."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from rollhub.envs.group.mock import MockEnv
from rollhub.errors import InvalidInput
from rollhub.experience import Group
from rollhub.inference.torch_policy import LocalPolicy
from rollhub.train.grpo import GRPOConfig, GRPOTrainer, groups_to_batch, grpo_loss
from rollhub.train.offpolicy import PRESETS
from rollhub.wire.group import group_from_json

PROMPT = -100


def _groups(policy: LocalPolicy, version: int | None = 0, seed: int = 0, n_groups: int = 4) -> list[Group]:
    """Groups sampled by ``policy`` (its own log-probs stored), labelled with ``version``."""
    groups, _ = MockEnv(max_tokens=3).sample(policy, n_groups, 6, "train", np.random.default_rng(seed))
    for g in groups:
        g.policy_version = version
    return groups


def _shift_behaviour(groups: list[Group], delta: float) -> list[Group]:
    """Add ``delta`` to every stored completion log-prob (prompt fillers untouched)."""
    for g in groups:
        lp = g.inference_logprobs
        assert lp is not None
        lp.data = np.where(g.masks.data != PROMPT, lp.data + delta, lp.data).astype(lp.data.dtype)
    return groups


def _completion_tokens(groups: list[Group]) -> int:
    # position 0 is never scored; it is always a prompt token here
    return int(sum((g.masks.data != PROMPT).sum() for g in groups))


def test_mismatch_is_zero_when_the_behaviour_is_the_trainer_itself(policy: LocalPolicy) -> None:
    groups = _groups(policy)
    stats = GRPOTrainer(policy.model, GRPOConfig(epochs=2)).step(groups)
    # measured before the update: the second epoch's weights differ, the reported figures must not see them
    assert stats["mismatch_abs"] < 1e-5 and abs(stats["mismatch_kl"]) < 1e-5
    assert stats["mismatch_tokens"] == _completion_tokens(groups)


@pytest.mark.parametrize("delta", [0.3, -0.3, 1.0])
def test_mismatch_of_a_constant_shift_is_known(policy: LocalPolicy, delta: float) -> None:
    """Behaviour log-probs = the trainer's + delta, so log r = -delta on every token: |log r| = |delta| and
    k3 = (e^-delta - 1) + delta."""
    groups = _shift_behaviour(_groups(policy), delta)
    stats = GRPOTrainer(policy.model, GRPOConfig(mismatch_warn=None)).step(groups)
    assert stats["mismatch_abs"] == pytest.approx(abs(delta), abs=1e-5)
    assert stats["mismatch_kl"] == pytest.approx(math.expm1(-delta) + delta, abs=1e-5)
    assert stats["mismatch_tokens"] == _completion_tokens(groups)


def test_mismatch_is_measured_on_the_trainers_own_version_only(policy: LocalPolicy) -> None:
    trainer = GRPOTrainer(policy.model, GRPOConfig())
    trainer.step_count = 5
    current, unversioned = _groups(policy, version=5), _groups(policy, version=None, seed=1)
    older = _shift_behaviour(_groups(policy, version=4, seed=2), 1.0)
    stats = trainer.step(older + current + unversioned)
    assert stats["mismatch_abs"] < 1e-5 and abs(stats["mismatch_kl"]) < 1e-5
    assert stats["mismatch_tokens"] == _completion_tokens(current + unversioned)


def test_an_all_old_batch_reports_no_mismatch_and_stays_valid_json(policy: LocalPolicy) -> None:
    trainer = GRPOTrainer(policy.model, GRPOConfig())
    trainer.step_count = 5
    stats = trainer.step(_groups(policy, version=4) + _groups(policy, version=3, seed=1))
    assert stats["mismatch_tokens"] == 0
    assert "mismatch_abs" not in stats and "mismatch_kl" not in stats  # left out, never NaN
    json.dumps(stats, allow_nan=False)  # what a strict reader of metrics.jsonl accepts


def test_a_mismatch_above_the_threshold_is_logged_with_its_numbers(
    policy: LocalPolicy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rollhub.train.grpo")
    groups = _shift_behaviour(_groups(policy), 0.2)
    stats = GRPOTrainer(policy.model, GRPOConfig(mismatch_warn=0.05)).step(groups)
    (record,) = [r for r in caplog.records if r.name == "rollhub.train.grpo"]
    message = record.getMessage()
    assert record.levelno == logging.WARNING and "policy version 0" in message
    assert f"mismatch_abs {stats['mismatch_abs']:.4g} > mismatch_warn 0.05" in message
    assert f"mismatch_kl {stats['mismatch_kl']:.4g} over {_completion_tokens(groups)} tokens" in message
    assert "precision" in message and "did not reach" in message


@pytest.mark.parametrize(("delta", "warn"), [(0.02, 0.05), (0.2, None)])
def test_no_warning_below_the_threshold_or_when_off(
    policy: LocalPolicy, caplog: pytest.LogCaptureFixture, delta: float, warn: float | None
) -> None:
    caplog.set_level(logging.WARNING, logger="rollhub.train.grpo")
    stats = GRPOTrainer(policy.model, GRPOConfig(mismatch_warn=warn)).step(_shift_behaviour(_groups(policy), delta))
    assert stats["mismatch_abs"] == pytest.approx(delta, abs=1e-5)
    assert not [r for r in caplog.records if r.name == "rollhub.train.grpo"]


def test_dual_clip_bounds_the_loss_of_negative_advantages(policy: LocalPolicy) -> None:
    """Plain PPO against the behaviour (the ``ppo`` preset), behaviour log-probs 5 nats below the trainer's:
    r = e^5 ~ 148. With A < 0 every token adds ``c * |A|`` (and no gradient) under dual clipping at c = 3,
    ``r * |A|`` without it."""
    batch = groups_to_batch(_groups(policy))
    batch.behaviour_logprobs -= batch.loss_mask * 5.0
    batch.advantages = -(batch.advantages.abs() + 1.0)
    mask = batch.loss_mask[:, 1:]
    mean_abs_adv = float((batch.advantages.abs()[:, None] * mask).sum() / mask.sum())

    ppo = PRESETS["ppo"]
    capped, stats = grpo_loss(policy.model, batch, clip_eps=0.2, correction=ppo, dual_clip=3.0)
    uncapped, free = grpo_loss(policy.model, batch, clip_eps=0.2, correction=ppo, dual_clip=None)
    assert float(capped.detach()) == pytest.approx(3.0 * mean_abs_adv, rel=1e-5)
    assert float(uncapped.detach()) == pytest.approx(math.exp(5.0) * mean_abs_adv, rel=1e-3)
    assert stats["dual_clip_fraction"] == 1.0 and free["dual_clip_fraction"] == 0.0
    assert stats["is_ratio_max"] == pytest.approx(math.exp(5.0), rel=1e-3)
    capped.backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in policy.model.parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_no_correction_changes_a_fresh_on_policy_batch(policy: LocalPolicy, name: str) -> None:
    """On the trainer's own samples every importance weight is 1 (to float32 rounding): each preset, with dual
    clipping, gives uncorrected PPO's loss and gradient."""
    groups = _groups(policy)

    def loss_and_grads(**kwargs) -> tuple[torch.Tensor, dict[str, float], list[torch.Tensor]]:
        policy.model.zero_grad(set_to_none=True)
        loss, stats = grpo_loss(policy.model, groups_to_batch(groups), clip_eps=0.2, **kwargs)
        loss.backward()
        return loss.detach(), stats, [p.grad.clone() for p in policy.model.parameters()]

    loss, stats, grads = loss_and_grads(correction=PRESETS[name], dual_clip=3.0)
    plain, _, plain_grads = loss_and_grads(correction=PRESETS["ppo"], dual_clip=None)
    assert stats["capped_fraction"] == 0.0 and stats["masked_fraction"] == 0.0
    assert stats["is_ratio_max"] == pytest.approx(1.0, abs=1e-5) and stats["ess_fraction"] == pytest.approx(1.0)
    assert float(loss) == pytest.approx(float(plain), abs=1e-6)
    for mine, theirs in zip(grads, plain_grads, strict=True):
        assert torch.allclose(mine, theirs, atol=1e-6)


@pytest.mark.parametrize(("field", "value"), [("dual_clip", 1.0), ("dual_clip", 1.2), ("mismatch_warn", 0.0)])
def test_bad_settings_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(InvalidInput, match=field):
        GRPOConfig(**{field: value})


def test_importing_the_trainer_does_not_need_transformers() -> None:
    code = "import sys, rollhub.train.grpo; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def _hf_group(model: torch.nn.Module, tokenizer, prompt: str, answers: list[str], scores: list[float]) -> Group:
    """A group of real token sequences (prompt, then answer and <eos>) whose behaviour log-probs come from
    one unpadded forward pass of ``model`` per sequence."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    rows: dict[str, list] = {"tokens": [], "masks": [], "inference_logprobs": []}
    for answer in answers:
        completion = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = prompt_ids + completion
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        token_lp = logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()
        rows["tokens"].append(ids)
        rows["masks"].append([PROMPT] * len(prompt_ids) + completion)
        rows["inference_logprobs"].append([1.0] * len(prompt_ids) + token_lp[len(prompt_ids) - 1 :])
    return group_from_json({**rows, "scores": scores, "policy_version": 0})


def test_a_grpo_step_on_a_hugging_face_model(tmp_path) -> None:
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from rollhub.models import build_tiny_model, load_causal_lm, load_tokenizer

    directory = build_tiny_model(tmp_path / "m")
    model, tokenizer = load_causal_lm(str(directory)), load_tokenizer(str(directory))
    prompt_ids = tokenizer("12+34=")["input_ids"]
    assert prompt_ids[0] == tokenizer.bos_token_id and len(prompt_ids) == 7  # <bos> and one token per character
    group = _hf_group(model, tokenizer, "12+34=", ["46", "47", "5", "46"], [1.0, 0.0, 0.0, 1.0])

    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-3))
    before = trainer.weights()
    stats = trainer.step([group])
    after = trainer.weights()
    assert stats["mismatch_abs"] < 1e-4 and stats["mismatch_tokens"] == _completion_tokens([group])
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(after)
    assert any(not torch.equal(before[k], after[k]) for k in after)

    # the trained weights under their Hugging Face names are a checkpoint the model's own loader opens
    save_file(after, str(directory / "model.safetensors"), metadata={"format": "pt"})
    reloaded = load_causal_lm(str(directory)).state_dict()
    for name, value in after.items():
        assert torch.equal(reloaded[name], value), name


def test_the_run_config_sets_the_correction_dual_clip_and_warning_and_false_turns_them_off() -> None:
    """``trainer.correction``, ``trainer.dual_clip`` and ``trainer.mismatch_warn`` reach the trainer; ``false``
    (TOML has no null) is ``None`` and survives the written ``config.toml``; bad values are refused by key, and the
    old ``ratio_cap`` says what it became."""
    import tomllib
    from importlib.resources import files

    from rollhub.run.assemble import grpo_trainer
    from rollhub.run.config import RunConfigError, load_config
    from rollhub.run.group_parts import LocalBackend

    def make_trainer(config, resumed):
        return grpo_trainer(config, resumed, LocalBackend(config.policy).trainer_model())

    from rollhub.run.toml import dumps

    data = tomllib.loads(files("rollhub.run.configs").joinpath("arithmetic.toml").read_text())
    defaults = make_trainer(load_config(data), None).config
    assert defaults.dual_clip == 3.0 and defaults.correction == PRESETS["tis"]
    config = load_config(data, ["trainer.dual_clip=5.0", "trainer.mismatch_warn=0.1", "trainer.correction='icepop'",
                                "trainer.correction_bounds=[0.25, 4.0]"])  # fmt: skip
    grpo = make_trainer(config, None).config
    assert (grpo.dual_clip, grpo.mismatch_warn) == (5.0, 0.1)
    assert (grpo.correction.weight, grpo.correction.low, grpo.correction.high) == ("token_mask", 0.25, 4.0)
    off = load_config(data, ["trainer.dual_clip=false", "trainer.mismatch_warn=false"])
    assert (off.trainer.dual_clip, off.trainer.mismatch_warn) == (None, None)
    assert load_config(tomllib.loads(dumps(off.model_dump(mode="json")))).trainer == off.trainer
    for bad in ("trainer.dual_clip=1.2", "trainer.mismatch_warn=0", "trainer.mismatch_warn=true",
                "trainer.correction='bogus'", "trainer.correction_bounds=[2.0, 1.0]"):  # fmt: skip
        with pytest.raises(RunConfigError, match=bad.split("=")[0]):
            load_config(data, [bad])
    with pytest.raises(RunConfigError, match="dual_clip"):
        load_config(data, ["trainer.ratio_cap=3.0"])
