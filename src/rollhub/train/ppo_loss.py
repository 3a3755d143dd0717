"""The pieces of one PPO update that :class:`rollhub.train.ppo.PPOLearner` puts together, in plain sight.

* :func:`linear_schedule`: a hyperparameter moved linearly from its start to a floor over a horizon of trained
  environment steps, then held at the floor.
* :func:`minibatch_bounds`: how a batch of ``n`` samples is cut into minibatches, by count or by size.
* :func:`ppo_losses`: the clipped surrogate, the (optionally clipped) value loss and the entropy of one minibatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
class LossTerms:
    """One minibatch's loss and the statistics an update reports."""

    loss: torch.Tensor
    policy_loss: float
    value_loss: float
    entropy: float
    clip_frac: float


def value_loss(
    value: torch.Tensor, returns: torch.Tensor, old_value: torch.Tensor, clip_vf: float | None
) -> torch.Tensor:
    """``0.5 * mean((value - returns)^2)``; with ``clip_vf`` the prediction may also be taken as
    ``old_value + clamp(value - old_value, -clip_vf, clip_vf)`` and the larger of the two squared errors counts
    per sample, so the critic gains nothing from moving more than ``clip_vf`` away from the behaviour critic."""
    unclipped = (value - returns).pow(2)
    if clip_vf is None:
        return 0.5 * unclipped.mean()
    clipped = old_value + (value - old_value).clamp(-clip_vf, clip_vf)
    return 0.5 * torch.max(unclipped, (clipped - returns).pow(2)).mean()


@dataclass(frozen=True)
class LossSettings:
    """The coefficients of :func:`ppo_losses` for one update (``clip`` may follow a schedule)."""

    clip: float
    clip_vf: float | None
    vf_coef: float
    ent_coef: float
    norm_adv: bool


def ppo_losses(
    dist: torch.distributions.Categorical,
    value: torch.Tensor,
    actions: torch.Tensor,
    behaviour_logp: torch.Tensor,
    behaviour_value: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    s: LossSettings,
) -> LossTerms:
    """The PPO loss of one minibatch: importance ratios against the behaviour log-probs, the clipped surrogate
    on (per-minibatch normalised, when ``norm_adv``) advantages, plus ``vf_coef`` x value loss minus
    ``ent_coef`` x entropy."""
    ratio = torch.exp(dist.log_prob(actions) - behaviour_logp)
    adv = advantages
    if s.norm_adv and adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    policy_loss = -torch.min(ratio * adv, ratio.clamp(1 - s.clip, 1 + s.clip) * adv).mean()
    v_loss = value_loss(value, returns, behaviour_value, s.clip_vf)
    entropy = dist.entropy().mean()
    loss = policy_loss + s.vf_coef * v_loss - s.ent_coef * entropy
    clip_frac = ((ratio - 1).abs() > s.clip).float().mean().item()
    return LossTerms(loss, policy_loss.item(), v_loss.item(), entropy.item(), clip_frac)
