"""The fleet's MLP inference policy computes what the trainer's ActorCritic computes from the same state_dict, and
samples from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollhub.errors import ConfigError
from rollhub.inference.mlp_policy import BLOCK_ROWS, MLPStepPolicy
from rollhub.train.ppo import PPOLearner


def _policy(seed: int = 1) -> tuple[MLPStepPolicy, PPOLearner]:
    learner = PPOLearner(4, 3)
    rng = np.random.default_rng(0)
    weights = {k: v + 0.5 * rng.standard_normal(v.shape).astype(np.float32) for k, v in learner.weights().items()}
    learner.model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    policy = MLPStepPolicy(4, 3, 64, seed=seed)
    policy.load_weights(weights)
    return policy, learner


@pytest.mark.parametrize("n", [1, BLOCK_ROWS, BLOCK_ROWS + 1, 300])  # both ways of running the second layers
def test_log_probs_and_values_match_the_trainers_model(n: int) -> None:
    policy, learner = _policy()
    obs = np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)
    out = policy.act(obs, None)
    with torch.no_grad():
        dist, value = learner.model(torch.from_numpy(obs))
        expected_logp = dist.log_prob(torch.from_numpy(out.actions)).numpy()
    assert out.actions.shape == (n,) and out.actions.dtype == np.int64
    np.testing.assert_allclose(out.logp, expected_logp, atol=1e-5)
    np.testing.assert_allclose(out.values, value.numpy(), atol=1e-5)
    np.testing.assert_allclose(policy.value(obs), value.numpy(), atol=1e-5)


def test_actions_are_drawn_from_the_policy_distribution() -> None:
    policy, learner = _policy()
    obs = np.random.default_rng(2).standard_normal((1, 4)).astype(np.float32)
    with torch.no_grad():
        probs = learner.model(torch.from_numpy(obs))[0].probs.numpy()[0]
    # small calls cross the blocks of pre-drawn uniforms (UNIFORM_BLOCK) many times; the large one is a block
    sizes = [1, 7, 40_000, *[3] * 5000]
    draws = np.concatenate([policy.act(np.repeat(obs, size, axis=0), None).actions for size in sizes])
    freq = np.bincount(draws, minlength=3) / len(draws)
    # about 55,000 draws: each frequency is within 4 standard errors of its probability
    assert np.all(np.abs(freq - probs) <= 4 * np.sqrt(probs * (1 - probs) / len(draws)) + 1e-9), (freq, probs)


def test_the_seed_fixes_the_actions() -> None:
    obs = np.random.default_rng(3).standard_normal((64, 4)).astype(np.float32)
    first, again, other = (_policy(seed)[0].act(obs, None).actions for seed in (5, 5, 6))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_new_weights_are_used_from_the_next_call() -> None:
    policy, learner = _policy()
    obs = np.ones((2, 4), np.float32)
    before = policy.value(obs)
    policy.load_weights({k: np.zeros_like(v) for k, v in learner.weights().items()})
    assert not np.allclose(before, 0) and np.allclose(policy.value(obs), 0)


def test_starts_from_a_fresh_actor_critic_without_weights() -> None:
    policy = MLPStepPolicy(4, 2, 8, seed=0)
    out = policy.act(np.zeros((3, 4), np.float32), None)
    np.testing.assert_allclose(out.values, 0.0)  # zero biases, zero observations
    np.testing.assert_allclose(out.logp, np.log(0.5), atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda w: w.pop("critic.2.bias"), r"missing \['critic.2.bias'\]"),
        (lambda w: w.update(extra=np.zeros(1)), r"unknown \['extra'\]"),
        (lambda w: w.update({"actor.0.weight": np.zeros((64, 5))}), r"actor.0.weight has shape \(64, 5\)"),
    ],
)
def test_bad_weights_are_refused_by_name_and_change_nothing(change, message) -> None:
    policy, learner = _policy()
    obs = np.ones((2, 4), np.float32)
    before = policy.value(obs)
    weights = learner.weights()
    change(weights)
    with pytest.raises(ConfigError, match=message):
        policy.load_weights(weights)
    np.testing.assert_array_equal(policy.value(obs), before)


def test_building_the_policy_runs_blas_on_one_thread() -> None:
    from threadpoolctl import threadpool_info, threadpool_limits

    before = {p["filepath"]: p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}
    assert before, "numpy loads a BLAS library"
    try:
        threadpool_limits(2, user_api="blas")  # as a process on two cores starts
        MLPStepPolicy(4, 2, 8, seed=0)
        assert [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"] == [1] * len(before)
    finally:
        threadpool_limits(max(before.values(), default=1), user_api="blas")
