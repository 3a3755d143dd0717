"""The PPO loss through autograd (rollhub.train.ppo_loss) against a reference written with torch's Categorical,
and the hand-written numpy gradients (rollhub.train.ppo_numpy, ``backend = "numpy"``) against autograd's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from rollhub.inference.actor_critic import ActorCritic
from rollhub.train.ppo import PPOConfig, PPOLearner
from rollhub.train.ppo_loss import LossSettings, Minibatch, clip_grad_norm, ppo_loss
from rollhub.train.ppo_numpy import clip_global_norm, numpy_layers, ppo_gradients
from tests.train.test_ppo_options import _fragments


def reference_loss(model: ActorCritic, mb: Minibatch, s: LossSettings) -> torch.Tensor:
    """The PPO loss of ppo_loss's docstring, written another way: through the model's Categorical distribution."""
    dist, value = model(mb.obs)
    ratio = torch.exp(dist.log_prob(mb.actions) - mb.behaviour_logp)
    adv = mb.advantages
    if s.norm_adv and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    policy = -torch.min(ratio * adv, ratio.clamp(1 - s.clip, 1 + s.clip) * adv).mean()
    returns, old = mb.returns, mb.behaviour_value
    squared = (value - returns).pow(2)
    if s.clip_vf is not None:
        clipped = old + (value - old).clamp(-s.clip_vf, s.clip_vf)
        squared = torch.max(squared, (clipped - returns).pow(2))
    return policy + s.vf_coef * 0.5 * squared.mean() - s.ent_coef * dist.entropy().mean()


def minibatch(n: int, obs_dim: int, n_actions: int, seed: int) -> Minibatch:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    arrays = (
        rng.standard_normal((n, obs_dim)).astype(f32), rng.integers(0, n_actions, n),
        (np.log(1 / n_actions) + 0.3 * rng.standard_normal(n)).astype(f32),  # ratios beyond the clip
        rng.standard_normal(n).astype(f32), (2 * rng.standard_normal(n)).astype(f32),
        rng.standard_normal(n).astype(f32),
    )  # fmt: skip
    return Minibatch(*(torch.from_numpy(a) for a in arrays))


SETTINGS = [
    LossSettings(clip=0.2, clip_vf=None, vf_coef=0.5, ent_coef=0.0, norm_adv=True),
    LossSettings(clip=0.1, clip_vf=0.3, vf_coef=1.0, ent_coef=0.01, norm_adv=True),
    LossSettings(clip=0.3, clip_vf=0.05, vf_coef=0.25, ent_coef=0.1, norm_adv=False),
]
SHAPES = [(4, 2, 64, 256), (7, 5, 16, 33), (3, 3, 8, 1)]


def _model(obs_dim: int, n_actions: int, hidden: int, seed: int) -> ActorCritic:
    torch.manual_seed(seed)
    model = ActorCritic(obs_dim, n_actions, hidden)
    with torch.no_grad():
        for p in model.parameters():  # away from the tiny initial actor head, so that ratios and entropy move
            p += 0.3 * torch.randn_like(p)
    return model


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize(("obs_dim", "n_actions", "hidden", "n"), SHAPES)
def test_the_loss_and_its_terms_equal_the_reference(
    s: LossSettings, obs_dim: int, n_actions: int, hidden: int, n: int
) -> None:
    model = _model(obs_dim, n_actions, hidden, seed=n)
    mb = minibatch(n, obs_dim, n_actions, seed=hidden)
    loss, stats = ppo_loss(model, mb, s)
    reference = reference_loss(model, mb, s)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5, abs=1e-6)
    total = stats.policy_loss + s.vf_coef * stats.value_loss - s.ent_coef * stats.entropy
    assert total == pytest.approx(reference.item(), rel=1e-5, abs=1e-6)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = torch.autograd.grad(reference, list(model.parameters()))
    for name, g, e in zip([k for k, _ in model.named_parameters()], grads, expected, strict=True):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize(("obs_dim", "n_actions", "hidden", "n"), SHAPES)
def test_numpy_gradients_and_terms_equal_autograd(
    s: LossSettings, obs_dim: int, n_actions: int, hidden: int, n: int
) -> None:
    model = _model(obs_dim, n_actions, hidden, seed=n)
    mb = minibatch(n, obs_dim, n_actions, seed=hidden)
    loss, expected = ppo_loss(model, mb, s)
    loss.backward()
    grads, stats = ppo_gradients(numpy_layers(model.actor), numpy_layers(model.critic), mb, s)
    names = [name for name, _ in model.named_parameters()]
    assert len(grads) == len(names)
    for name, p, g in zip(names, model.parameters(), grads, strict=True):
        assert g.shape == p.shape and g.dtype == np.float32, name
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    for key in ("policy_loss", "value_loss", "entropy", "clip_frac"):
        assert getattr(stats, key) == pytest.approx(getattr(expected, key), rel=1e-5, abs=1e-6), key


def test_the_minibatch_exercises_both_sides_of_the_clip() -> None:
    mb, s = minibatch(256, 4, 2, seed=64), SETTINGS[0]
    _, stats = ppo_loss(ActorCritic(4, 2), mb, s)
    assert 0.1 < stats.clip_frac < 0.9  # so the gradient tests cover clipped and unclipped samples


def test_clip_global_norm_matches_torch() -> None:
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(shape).astype(np.float32) for shape in [(8, 3), (8,), (2, 8)]]
    tensors = [torch.from_numpy(g.copy()).requires_grad_() for g in grads]
    for t, g in zip(tensors, grads, strict=True):
        t.grad = torch.from_numpy(g.copy())
    before = nn.utils.clip_grad_norm_(tensors, 0.5)
    assert clip_global_norm(grads, 0.5) == pytest.approx(before.item(), rel=1e-6)
    for t, g in zip(tensors, grads, strict=True):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-6)
    small = [np.full(3, 0.1, np.float32)]
    clip_global_norm(small, 10.0)
    np.testing.assert_array_equal(small[0], np.full(3, 0.1, np.float32))  # under the bound: untouched


def test_clip_grad_norm_matches_torch() -> None:
    rng = np.random.default_rng(1)
    grads = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) for shape in [(8, 3), (8,), (2, 8)]]
    tensors = [g.clone().requires_grad_() for g in grads]
    for t, g in zip(tensors, grads, strict=True):
        t.grad = g.clone()
    before = nn.utils.clip_grad_norm_(tensors, 0.5)
    assert clip_grad_norm(grads, 0.5) == pytest.approx(before.item(), rel=1e-6)
    for t, g in zip(tensors, grads, strict=True):
        np.testing.assert_allclose(g.numpy(), t.grad.numpy(), rtol=1e-6)
    small = [torch.full((3,), 0.1)]
    clip_grad_norm(small, 10.0)
    np.testing.assert_array_equal(small[0].numpy(), np.full(3, 0.1, np.float32))  # under the bound: untouched


def test_an_update_with_either_backend_takes_the_same_steps() -> None:
    """Two epochs of two minibatches: the weights and the reported terms after update() are the same whichever
    backend takes the gradients (the same minibatches, norm clipping and Adam)."""
    cfg = PPOConfig(epochs=2, minibatches=2, clip_vf=0.2, ent_coef=0.01, seed=5)
    autograd, hand = PPOLearner(3, 2, cfg), PPOLearner(3, 2, PPOConfig(**{**vars(cfg), "backend": "numpy"}))
    data = _fragments(2, 40)
    a_stats, h_stats = autograd.update(data), hand.update(data)
    for (name, a), b in zip(autograd.model.named_parameters(), hand.model.parameters(), strict=True):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    assert autograd.optimizer.steps == hand.optimizer.steps == 4
    assert h_stats == pytest.approx(a_stats, rel=1e-4, abs=1e-6)
    assert not np.allclose(autograd.weights()["actor.4.weight"], PPOLearner(3, 2, cfg).weights()["actor.4.weight"])


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="backend must be 'autograd' or 'numpy'"):
        PPOConfig(backend="jax")  # type: ignore[arg-type]
