"""The pieces of one PPO update that :class:`rollhub.train.ppo.PPOLearner` puts together, in plain sight.

* :func:`linear_schedule`: a hyperparameter moved linearly from its start to a floor over a horizon of trained
  environment steps, then held at the floor.
* :func:`minibatch_bounds`: how a batch of ``n`` samples is cut into minibatches, by count or by size.
* :func:`clip_grad_norm`: gradient-norm clipping in a few multi-tensor operations.
* :func:`ppo_loss`: the clipped surrogate, the (optionally clipped) value loss and the entropy of one minibatch
  through the :class:`rollhub.inference.actor_critic.ActorCritic`, as one torch scalar to take ``backward()`` of,
  and the terms an update reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollhub.inference.actor_critic import ActorCritic


def linear_schedule(start: float, final: float | None, horizon: int, step: int) -> float:
    """``start`` at step 0, moved linearly to ``final`` at ``horizon`` trained steps, ``final`` from there on.

    ``final=None`` is a constant ``start``. Past the horizon the value stays at ``final`` (a run that trains
    longer than planned keeps learning at the floor rather than stopping at zero).
    """
    if final is None:
        return start
    progress = min(max(step, 0) / horizon, 1.0)
    return start + (final - start) * progress


def minibatch_bounds(n: int, minibatches: int | None, minibatch_size: int | None) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(n)``: chunks of ``minibatch_size`` samples (the last may be
    shorter), else ``minibatches`` equal chunks (default 4); at most ``n`` chunks, never an empty one."""
    if minibatch_size is not None and minibatches is not None:
        raise ValueError("minibatches and minibatch_size are both set; set one of them")
    size = max(n // (minibatches or 4), 1) if minibatch_size is None else max(min(minibatch_size, n), 1)
    return [(start, min(start + size, n)) for start in range(0, n, size)]


@dataclass(frozen=True)
class LossSettings:
    """The coefficients of :func:`ppo_loss` for one update (``clip`` may follow a schedule)."""

    clip: float
    clip_vf: float | None
    vf_coef: float
    ent_coef: float
    norm_adv: bool


@dataclass(frozen=True)
class Minibatch:
    """The samples of one minibatch (float32 tensors of ``[n]`` unless noted)."""

    obs: torch.Tensor  # [n, obs_dim]
    actions: torch.Tensor  # [n] int64
    behaviour_logp: torch.Tensor
    behaviour_value: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    def rows(self, index: torch.Tensor) -> Minibatch:
        """The minibatch of the samples at ``index``."""
        return Minibatch(
            self.obs[index], self.actions[index], self.behaviour_logp[index], self.behaviour_value[index],
            self.advantages[index], self.returns[index],
        )  # fmt: skip


@dataclass(frozen=True)
class LossStats:
    """What an update reports of one minibatch's loss."""

    policy_loss: float
    value_loss: float
    entropy: float
    clip_frac: float


def value_loss(
    value: torch.Tensor, returns: torch.Tensor, old_value: torch.Tensor, clip_vf: float | None
) -> torch.Tensor:
    """``0.5 * mean((value - returns)^2)``.

    With ``clip_vf`` the prediction may also be taken as ``old_value + clip(value - old_value, -clip_vf,
    clip_vf)`` and the larger of the two squared errors counts per sample, so the critic gains nothing from
    moving more than ``clip_vf`` away from the behaviour critic: where the clipped error is the larger one, the
    prediction is outside the range and its gradient is 0.
    """
    squared = (value - returns).square()
    if clip_vf is not None:
        clipped = old_value + (value - old_value).clamp(-clip_vf, clip_vf)
        squared = torch.maximum(squared, (clipped - returns).square())
    return 0.5 * squared.mean()


def ppo_loss(model: ActorCritic, mb: Minibatch, s: LossSettings) -> tuple[torch.Tensor, LossStats]:
    """One minibatch's PPO loss, to differentiate, and its terms.

    The loss: importance ratios against the behaviour log-probs, the clipped surrogate on (per-minibatch
    normalised, when ``norm_adv``) advantages, plus ``vf_coef`` x :func:`value_loss` minus ``ent_coef`` x the
    mean entropy. ``clip_frac`` is the share of samples whose ratio lies outside ``1 +- clip``.
    """
    logp_all = torch.log_softmax(model.actor(mb.obs), dim=1)
    value = model.critic(mb.obs)[:, 0]
    ratio = torch.exp(logp_all.gather(1, mb.actions[:, None])[:, 0] - mb.behaviour_logp)
    adv = mb.advantages
    if s.norm_adv and adv.shape[0] > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    policy = -torch.minimum(ratio * adv, ratio.clamp(1 - s.clip, 1 + s.clip) * adv).mean()
    entropy = -(logp_all.exp() * logp_all).sum(1).mean()
    v_loss = value_loss(value, mb.returns, mb.behaviour_value, s.clip_vf)
    loss = policy + s.vf_coef * v_loss
    if s.ent_coef:
        loss = loss - s.ent_coef * entropy
    clip_frac = ((ratio.detach() - 1).abs() > s.clip).float().mean()
    stats = LossStats(policy.item(), v_loss.item(), entropy.item(), clip_frac.item())
    return loss, stats


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float) -> float:
    """Scale ``grads`` in place so that their global L2 norm is at most ``max_norm``; return the norm before.

    What ``torch.nn.utils.clip_grad_norm_`` does, in a quarter of its time on the actor-critic's 12 small tensors
    on CPU: the scale is a Python float, and gradients under the bound are left alone.
    """
    total = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        torch._foreach_mul_(grads, scale)
    return total
