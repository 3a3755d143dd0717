"""GRPOConfig's cosine annealing of the learning rate and the entropy weight, and the trainer applying it."""

from __future__ import annotations

import numpy as np
import pytest

from rollhub.envs.group.mock import MockEnv
from rollhub.inference.torch_policy import LocalPolicy
from rollhub.train.grpo import GRPOConfig, GRPOTrainer


def test_annealed_follows_a_half_cosine_then_stays() -> None:
    cfg = GRPOConfig(lr=1e-3, lr_final=1e-4, anneal_steps=100)
    assert cfg.annealed(1e-3, 1e-4, 0) == pytest.approx(1e-3)
    assert cfg.annealed(1e-3, 1e-4, 50) == pytest.approx(5.5e-4)
    assert cfg.annealed(1e-3, 1e-4, 100) == pytest.approx(1e-4)
    assert cfg.annealed(1e-3, 1e-4, 1000) == pytest.approx(1e-4)
    values = [cfg.annealed(1e-3, 1e-4, s) for s in range(0, 101, 5)]
    assert values == sorted(values, reverse=True)


def test_no_final_value_or_no_anneal_steps_keeps_the_start_value() -> None:
    assert GRPOConfig(anneal_steps=100).annealed(0.3, None, 50) == 0.3
    assert GRPOConfig(anneal_steps=0).annealed(0.3, 0.1, 50) == 0.3


def test_trainer_sets_the_annealed_lr_and_entropy_weight_each_step(policy: LocalPolicy) -> None:
    cfg = GRPOConfig(lr=1e-2, lr_final=1e-3, entropy_coef=0.2, entropy_coef_final=0.0, anneal_steps=2)
    trainer = GRPOTrainer(policy.model, cfg)
    seen = []
    for seed in range(3):
        groups, _ = MockEnv(max_tokens=3).sample(policy, 4, 6, "train", np.random.default_rng(seed))
        stats = trainer.step(groups)
        seen.append((stats["lr"], stats["entropy_coef"], trainer.optimizer.param_groups[0]["lr"]))
    assert seen[0] == pytest.approx((1e-2, 0.2, 1e-2))
    assert seen[1] == pytest.approx((5.5e-3, 0.1, 5.5e-3))
    assert seen[2] == pytest.approx((1e-3, 0.0, 1e-3))
