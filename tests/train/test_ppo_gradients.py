"""The hand-written PPO gradients (rollhub.train.ppo_loss) against autograd on the same loss written in torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from rollhub.experience import SampleFragment
from rollhub.train.ppo import ActorCritic, PPOConfig, PPOLearner, compute_gae, numpy_layers
from rollhub.train.ppo_loss import LossSettings, Minibatch, clip_global_norm, minibatch_bounds, ppo_gradients
from tests.train.test_ppo_options import _fragments


def torch_loss(model: ActorCritic, mb: Minibatch, s: LossSettings) -> torch.Tensor:
    """The PPO loss of the module docstring of rollhub.train.ppo_loss, through torch's Categorical and autograd."""
    dist, value = model(torch.from_numpy(mb.obs))
    ratio = torch.exp(dist.log_prob(torch.from_numpy(mb.actions)) - torch.from_numpy(mb.behaviour_logp))
    adv = torch.from_numpy(mb.advantages)
    if s.norm_adv and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    policy = -torch.min(ratio * adv, ratio.clamp(1 - s.clip, 1 + s.clip) * adv).mean()
    returns, old = torch.from_numpy(mb.returns), torch.from_numpy(mb.behaviour_value)
    squared = (value - returns).pow(2)
    if s.clip_vf is not None:
        clipped = old + (value - old).clamp(-s.clip_vf, s.clip_vf)
        squared = torch.max(squared, (clipped - returns).pow(2))
    return policy + s.vf_coef * 0.5 * squared.mean() - s.ent_coef * dist.entropy().mean()


def minibatch(n: int, obs_dim: int, n_actions: int, seed: int) -> Minibatch:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    return Minibatch(
        obs=rng.standard_normal((n, obs_dim)).astype(f32), actions=rng.integers(0, n_actions, n),
        behaviour_logp=(np.log(1 / n_actions) + 0.3 * rng.standard_normal(n)).astype(f32),  # ratios beyond the clip
        behaviour_value=rng.standard_normal(n).astype(f32), advantages=(2 * rng.standard_normal(n)).astype(f32),
        returns=rng.standard_normal(n).astype(f32),
    )  # fmt: skip


SETTINGS = [
    LossSettings(clip=0.2, clip_vf=None, vf_coef=0.5, ent_coef=0.0, norm_adv=True),
    LossSettings(clip=0.1, clip_vf=0.3, vf_coef=1.0, ent_coef=0.01, norm_adv=True),
    LossSettings(clip=0.3, clip_vf=0.05, vf_coef=0.25, ent_coef=0.1, norm_adv=False),
]


@pytest.mark.parametrize("s", SETTINGS)
@pytest.mark.parametrize(("obs_dim", "n_actions", "hidden", "n"), [(4, 2, 64, 256), (7, 5, 16, 33), (3, 3, 8, 1)])
def test_gradients_and_losses_equal_autograd(
    s: LossSettings, obs_dim: int, n_actions: int, hidden: int, n: int
) -> None:
    torch.manual_seed(n)
    model = ActorCritic(obs_dim, n_actions, hidden)
    for p in model.parameters():  # away from the tiny initial actor head, so that ratios and entropy move
        p.data += 0.3 * torch.randn_like(p)
    mb = minibatch(n, obs_dim, n_actions, seed=hidden)
    loss = torch_loss(model, mb, s)
    loss.backward()
    grads, stats = ppo_gradients(numpy_layers(model.actor), numpy_layers(model.critic), mb, s)
    names = [name for name, _ in model.named_parameters()]
    assert len(grads) == len(names)
    for name, p, g in zip(names, model.parameters(), grads, strict=True):
        assert g.shape == p.shape and g.dtype == np.float32, name
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    total = stats.policy_loss + s.vf_coef * stats.value_loss - s.ent_coef * stats.entropy
    assert total == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)


def test_the_minibatch_exercises_both_sides_of_the_clip() -> None:
    mb, s = minibatch(256, 4, 2, seed=64), SETTINGS[0]
    _, stats = ppo_gradients(numpy_layers(ActorCritic(4, 2).actor), numpy_layers(ActorCritic(4, 2).critic), mb, s)
    assert 0.1 < stats.clip_frac < 0.9  # so the gradient test covers clipped and unclipped samples


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


def test_an_update_equals_the_same_steps_taken_through_autograd() -> None:
    """Two epochs of two minibatches: the learner's weights after update() are those of the same minibatch steps
    taken with torch's loss, backward, clip_grad_norm_ and the same Adam."""
    cfg = PPOConfig(epochs=2, minibatches=2, clip_vf=0.2, ent_coef=0.01, seed=5)
    learner, reference = PPOLearner(3, 2, cfg), PPOLearner(3, 2, cfg)
    data = _fragments(2, 40)
    learner.update(data)
    _autograd_update(reference, data)
    for (name, a), b in zip(learner.model.named_parameters(), reference.model.parameters(), strict=True):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    assert learner.optimizer.steps == reference.optimizer.steps == 4


def _autograd_update(learner: PPOLearner, fragments: list[SampleFragment]) -> None:
    cfg = learner.config
    gae = [compute_gae(f, cfg.gamma, cfg.gae_lambda) for f in fragments]
    data = Minibatch(
        np.concatenate([f.obs for f in fragments]), np.concatenate([f.actions for f in fragments]),
        np.concatenate([f.logp for f in fragments]), np.concatenate([f.values for f in fragments]),
        np.concatenate([a for a, _ in gae]), np.concatenate([r for _, r in gae]),
    )  # fmt: skip
    s = LossSettings(cfg.clip, cfg.clip_vf, cfg.vf_coef, cfg.ent_coef, cfg.norm_adv)
    n = data.obs.shape[0]
    for _ in range(cfg.epochs):
        order = learner.rng.permutation(n)
        for start, stop in minibatch_bounds(n, cfg.minibatches, cfg.minibatch_size):
            idx = order[start:stop]
            mb = Minibatch(data.obs[idx], data.actions[idx], data.behaviour_logp[idx], data.behaviour_value[idx],
                           data.advantages[idx], data.returns[idx])  # fmt: skip
            learner.optimizer.zero_grad()
            torch_loss(learner.model, mb, s).backward()
            nn.utils.clip_grad_norm_(learner.model.parameters(), cfg.max_grad_norm)
            learner.optimizer.step()
