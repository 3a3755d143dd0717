"""The fleet's MLP inference policy computes what the trainer's ActorCritic computes, and samples from it."""

from __future__ import annotations

import numpy as np
import torch

from rollhub.train.ppo import PPOLearner, TorchStepPolicy


def _policy() -> tuple[TorchStepPolicy, PPOLearner]:
    learner = PPOLearner(4, 3)
    rng = np.random.default_rng(0)
    weights = {k: v + 0.5 * rng.standard_normal(v.shape).astype(np.float32) for k, v in learner.weights().items()}
    learner.model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    policy = TorchStepPolicy(4, 3, 64, seed=1)
    policy.load_weights(weights)
    return policy, learner


def test_log_probs_and_values_match_the_trainers_model() -> None:
    policy, learner = _policy()
    obs = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
    out = policy.act(obs, None)
    with torch.no_grad():
        dist, value = learner.model(torch.from_numpy(obs))
        expected_logp = dist.log_prob(torch.from_numpy(out.actions)).numpy()
    np.testing.assert_allclose(out.logp, expected_logp, atol=1e-5)
    np.testing.assert_allclose(out.values, value.numpy(), atol=1e-5)
    np.testing.assert_allclose(policy.value(obs), value.numpy(), atol=1e-5)


def test_actions_are_drawn_from_the_policy_distribution() -> None:
    policy, learner = _policy()
    obs = np.random.default_rng(2).standard_normal((1, 4)).astype(np.float32)
    with torch.no_grad():
        probs = learner.model(torch.from_numpy(obs))[0].probs.numpy()[0]
    actions = policy.act(np.repeat(obs, 40_000, axis=0), None).actions
    freq = np.bincount(actions, minlength=3) / len(actions)
    # 40,000 draws: each frequency is within 4 standard errors of its probability
    assert np.all(np.abs(freq - probs) <= 4 * np.sqrt(probs * (1 - probs) / len(actions)) + 1e-9), (freq, probs)


def test_new_weights_are_used_from_the_next_call() -> None:
    policy, learner = _policy()
    obs = np.ones((2, 4), np.float32)
    before = policy.value(obs)
    policy.load_weights({k: np.zeros_like(v) for k, v in learner.weights().items()})
    assert not np.allclose(before, 0) and np.allclose(policy.value(obs), 0)
