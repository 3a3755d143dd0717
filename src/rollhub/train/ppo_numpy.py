"""The PPO gradients worked out by hand in numpy: an optional backend of :class:`rollhub.train.ppo.PPOLearner`.

``[trainer] backend = "numpy"`` takes each minibatch's gradients from :func:`ppo_gradients` instead of from
``backward()`` on :func:`rollhub.train.ppo_loss.ppo_loss`: the same loss (the same options, the same
:class:`~rollhub.train.ppo_loss.LossStats`), differentiated by hand for the actor-critic's tanh MLPs. On the small
networks and minibatches of the CartPole demo, torch's per-operation cost is much of an autograd step, and these
few numpy products take it in less time: an update of the demo's learner took 1.5-1.8x as long through autograd
(``benchmarks/ppo_update.py``). The test suite checks these gradients against autograd's for every loss option.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from rollhub.train.ppo_loss import LossSettings, LossStats, Minibatch

Layers = list[tuple[np.ndarray, np.ndarray]]
"""An MLP as its (weight ``[out, in]``, bias ``[out]``) pairs in order: tanh between layers, none after the last."""


def numpy_layers(mlp: nn.Sequential) -> Layers:
    """The (weight, bias) pairs of ``mlp``'s linear layers as numpy arrays that share the parameters' memory."""
    return [(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in mlp if isinstance(m, nn.Linear)]


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


def value_loss_and_gradient(
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
    """The gradients of one minibatch's :func:`rollhub.train.ppo_loss.ppo_loss` with respect to the actor's and
    then the critic's weights (in :func:`mlp_backward`'s order, which is ``ActorCritic.parameters()``'s), and
    the loss's terms. ``mb`` holds CPU tensors; they are read as numpy arrays without a copy."""
    obs, actions, behaviour_logp, behaviour_value, advantages, returns = (
        t.numpy() for t in (mb.obs, mb.actions, mb.behaviour_logp, mb.behaviour_value, mb.advantages, mb.returns)
    )
    n = obs.shape[0]
    rows = np.arange(n)
    a_acts, c_acts = mlp_forward(obs, actor), mlp_forward(obs, critic)
    logits = a_acts[-1]
    shifted = logits - logits.max(1, keepdims=True)
    logp_all = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    p = np.exp(logp_all)
    ratio = np.exp(logp_all[rows, actions] - behaviour_logp)
    adv = advantages
    if s.norm_adv and n > 1:
        adv = (adv - adv.mean()) / (adv.std(ddof=1) + 1e-8)
    surrogate, clipped = ratio * adv, np.clip(ratio, 1 - s.clip, 1 + s.clip) * adv
    # the minimum is the unclipped term, or equal to it: only there does the ratio carry a gradient
    d_logp = -(adv * (surrogate <= clipped)) * ratio / n
    d_logits = -p * d_logp[:, None]
    d_logits[rows, actions] += d_logp
    entropy = -(p * logp_all).sum(1)
    if s.ent_coef:
        d_logits += (s.ent_coef / n) * p * (logp_all + entropy[:, None])
    value = c_acts[-1][:, 0]
    v_loss, d_value = value_loss_and_gradient(value, returns, behaviour_value, s.clip_vf)
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
