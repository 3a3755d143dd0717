"""The pieces of one PPO update that :class:`rollhub.train.ppo.PPOLearner` puts together, in plain sight.

* :func:`linear_schedule`: a hyperparameter moved linearly from its start to a floor over a horizon of trained
  environment steps, then held at the floor.
* :func:`minibatch_bounds`: how a batch of ``n`` samples is cut into minibatches, by count or by size.
* :func:`ppo_gradients`: the clipped surrogate, the (optionally clipped) value loss and the entropy of one
  minibatch, and their gradients with respect to every weight of the actor and the critic.

The gradients are worked out by hand in numpy rather than by autograd. The networks are small tanh MLPs trained
on minibatches of a few hundred samples, where autograd's bookkeeping and torch's per-operation cost are most of
the time: a 256-sample step of the 64x64 CartPole actor-critic takes about a fifth of the time it takes through
``loss.backward()``. The test suite checks these gradients against autograd on the same loss written in torch,
for every loss option.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Layers = list[tuple[np.ndarray, np.ndarray]]
"""An MLP as its (weight ``[out, in]``, bias ``[out]``) pairs in order: tanh between layers, none after the last."""


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
    """The coefficients of :func:`ppo_gradients` for one update (``clip`` may follow a schedule)."""

    clip: float
    clip_vf: float | None
    vf_coef: float
    ent_coef: float
    norm_adv: bool


@dataclass(frozen=True)
class Minibatch:
    """The samples of one minibatch (float32 arrays of ``[n]`` unless noted)."""

    obs: np.ndarray  # [n, obs_dim]
    actions: np.ndarray  # [n] integers
    behaviour_logp: np.ndarray
    behaviour_value: np.ndarray
    advantages: np.ndarray
    returns: np.ndarray


@dataclass(frozen=True)
class LossStats:
    """What an update reports of one minibatch's loss."""

    policy_loss: float
    value_loss: float
    entropy: float
    clip_frac: float


def mlp_forward(x: np.ndarray, layers: Layers) -> list[np.ndarray]:
    """The input, every hidden activation and the output of the MLP ``layers`` on the rows of ``x``."""
    acts = [x]
    for w, b in layers[:-1]:
        acts.append(np.tanh(acts[-1] @ w.T + b))
    w, b = layers[-1]
    acts.append(acts[-1] @ w.T + b)
    return acts


def mlp_backward(acts: list[np.ndarray], layers: Layers, d_out: np.ndarray) -> list[np.ndarray]:
    """The gradients ``[dW1, db1, dW2, db2, ...]`` given the loss's gradient ``d_out`` at the MLP's output and
    the activations :func:`mlp_forward` returned."""
    grads: list[np.ndarray] = []
    d = d_out
    for k in range(len(layers) - 1, -1, -1):
        w, _ = layers[k]
        grads[:0] = [d.T @ acts[k], d.sum(0)]
        if k:
            h = acts[k]
            d = (d @ w) * (1.0 - h * h)  # through the layer and the tanh before it
    return grads


def value_loss(
    value: np.ndarray, returns: np.ndarray, old_value: np.ndarray, clip_vf: float | None
) -> tuple[float, np.ndarray]:
    """``0.5 * mean((value - returns)^2)`` and its gradient with respect to ``value``.

    With ``clip_vf`` the prediction may also be taken as ``old_value + clip(value - old_value, -clip_vf,
    clip_vf)`` and the larger of the two squared errors counts per sample, so the critic gains nothing from
    moving more than ``clip_vf`` away from the behaviour critic: where the clipped error is the larger one, the
    prediction is outside the range and its gradient is 0.
    """
    n = value.shape[0]
    error = value - returns
    squared = error * error
    if clip_vf is None:
        return 0.5 * float(squared.mean()), error / n
    clipped_error = old_value + np.clip(value - old_value, -clip_vf, clip_vf) - returns
    clipped = clipped_error * clipped_error
    worse = np.maximum(squared, clipped)
    return 0.5 * float(worse.mean()), np.where(squared >= clipped, error, 0.0).astype(value.dtype) / n


def ppo_gradients(actor: Layers, critic: Layers, mb: Minibatch, s: LossSettings) -> tuple[list[np.ndarray], LossStats]:
    """The gradients of one minibatch's PPO loss with respect to the actor's and then the critic's weights (in
    :func:`mlp_backward`'s order), and the loss's terms.

    The loss: importance ratios against the behaviour log-probs, the clipped surrogate on (per-minibatch
    normalised, when ``norm_adv``) advantages, plus ``vf_coef`` x :func:`value_loss` minus ``ent_coef`` x the
    mean entropy.
    """
    n = mb.obs.shape[0]
    rows = np.arange(n)
    a_acts, c_acts = mlp_forward(mb.obs, actor), mlp_forward(mb.obs, critic)
    logits = a_acts[-1]
    shifted = logits - logits.max(1, keepdims=True)
    logp_all = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    p = np.exp(logp_all)
    ratio = np.exp(logp_all[rows, mb.actions] - mb.behaviour_logp)
    adv = mb.advantages
    if s.norm_adv and n > 1:
        adv = (adv - adv.mean()) / (adv.std(ddof=1) + 1e-8)
    surrogate, clipped = ratio * adv, np.clip(ratio, 1 - s.clip, 1 + s.clip) * adv
    # the minimum is the unclipped term, or equal to it: only there does the ratio carry a gradient
    d_logp = -(adv * (surrogate <= clipped)) * ratio / n
    d_logits = -p * d_logp[:, None]
    d_logits[rows, mb.actions] += d_logp
    entropy = -(p * logp_all).sum(1)
    if s.ent_coef:
        d_logits += (s.ent_coef / n) * p * (logp_all + entropy[:, None])
    value = c_acts[-1][:, 0]
    v_loss, d_value = value_loss(value, mb.returns, mb.behaviour_value, s.clip_vf)
    grads = mlp_backward(a_acts, actor, d_logits) + mlp_backward(c_acts, critic, s.vf_coef * d_value[:, None])
    stats = LossStats(
        policy_loss=-float(np.minimum(surrogate, clipped).mean()), value_loss=v_loss, entropy=float(entropy.mean()),
        clip_frac=float((np.abs(ratio - 1) > s.clip).mean()),
    )  # fmt: skip
    return grads, stats


def clip_global_norm(grads: list[np.ndarray], max_norm: float) -> float:
    """Scale ``grads`` in place so that their global L2 norm is at most ``max_norm``; return the norm before."""
    total = float(np.sqrt(sum(float(np.vdot(g, g)) for g in grads)))
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in grads:
            g *= scale
    return total
