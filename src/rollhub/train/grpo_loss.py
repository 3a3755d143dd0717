"""The GRPO batch and loss: groups flattened to padded tensors, group-relative advantages, the clipped surrogate
with a truncated importance ratio, and the train-inference mismatch figures taken from the same forward pass.

:mod:`rollhub.train.grpo` (the trainer) re-exports everything public here.

The model is any causal LM called as ``model(token_ids)``: the built-in
:class:`~rollhub.inference.torch_policy.TinyTransformer` returns the logits tensor, a Hugging Face
``AutoModelForCausalLM`` an output object with ``.logits`` (:func:`rollhub.models.hf.logits_of` takes either).
Batches are right-padded, so a causal model needs no attention mask: padding only ever follows the positions
that are scored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rollhub.envs.group.scored import PROMPT_MASK
from rollhub.errors import InvalidInput
from rollhub.experience import Group
from rollhub.models.hf import logits_of

UNVERSIONED = -1  # TokenBatch.policy_versions of a group without a policy_version
DEFAULT_RATIO_CAP = 3.0
LOG_RATIO_LIMIT = 20.0  # log-ratios are clamped here before exp: an absurd behaviour log-prob stays finite


@dataclass(slots=True)
class TokenBatch:
    """A batch of groups flattened to padded tensors ``[sequences, time]``.

    Attributes:
        tokens: token ids, right-padded with 0.
        loss_mask: 1.0 where a completion token is predicted (position ``t`` predicts ``tokens[t]``).
        behaviour_logprobs: stored log-prob of ``tokens[t]`` where ``loss_mask`` is 1, else 0.
        advantages: one group-relative advantage per sequence.
        policy_versions: the policy version that produced each sequence (``-1``: unversioned).
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    policy_versions: np.ndarray

    def sampled_by(self, version: int) -> torch.Tensor:
        """``[sequences]`` of 1.0 where the sequence was sampled by exactly policy ``version`` (or is
        unversioned, so taken to be), else 0.0."""
        v = self.policy_versions
        return torch.from_numpy(((v == version) | (v == UNVERSIONED)).astype(np.float32))


def group_advantages(scores: np.ndarray, eps: float = 1e-4) -> np.ndarray:
    """``(score - group mean) / (group std + eps)``; zero for a group whose scores are all equal."""
    scores = np.asarray(scores, dtype=np.float64)
    if np.ptp(scores) == 0:  # all equal: no signal (and a std of exactly 0 is not guaranteed by rounding)
        return np.zeros_like(scores)
    return (scores - scores.mean()) / (scores.std() + eps)


def _check_group(i: int, group: Group) -> None:
    lp = group.inference_logprobs
    if lp is None or lp.n_rows != group.size:
        raise InvalidInput(
            f"group {i} has no inference_logprobs; GRPO needs the behaviour log-probs of every token",
            field="inference_logprobs",
            index=i,
        )
    lengths = group.tokens.lengths
    if not (np.array_equal(group.masks.lengths, lengths) and np.array_equal(lp.lengths, lengths)):
        raise InvalidInput(f"group {i} has a row whose tokens, masks and log-probs differ in length", index=i)


def groups_to_batch(groups: list[Group], eps: float = 1e-4) -> TokenBatch:
    """Flatten groups into a :class:`TokenBatch` (advantages computed per group).

    Raises:
        InvalidInput: a group lacks ``inference_logprobs`` or has rows of different lengths.
    """
    for i, group in enumerate(groups):
        _check_group(i, group)
    lengths = np.concatenate([g.tokens.lengths for g in groups])
    n, width = len(lengths), int(lengths.max())
    rows = np.repeat(np.arange(n), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    cols = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
    flat_mask = np.concatenate([g.masks.data for g in groups]) != PROMPT_MASK
    flat_lp = np.concatenate([g.inference_logprobs.data for g in groups if g.inference_logprobs is not None])
    tokens = np.zeros((n, width), dtype=np.int64)
    loss_mask = np.zeros((n, width), dtype=np.float32)
    behaviour = np.zeros((n, width), dtype=np.float32)
    tokens[rows, cols] = np.concatenate([g.tokens.data for g in groups])
    loss_mask[rows, cols] = flat_mask
    behaviour[rows, cols] = np.where(flat_mask, flat_lp, 0.0)
    versions = [np.full(g.size, UNVERSIONED if g.policy_version is None else g.policy_version) for g in groups]
    return TokenBatch(
        tokens=torch.from_numpy(tokens),
        loss_mask=torch.from_numpy(loss_mask),
        behaviour_logprobs=torch.from_numpy(behaviour),
        advantages=torch.from_numpy(np.concatenate([group_advantages(g.scores, eps) for g in groups])).float(),
        policy_versions=np.concatenate(versions),
    )


def token_logprobs(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass: the log-prob of each ``tokens[:, t]`` given ``tokens[:, :t]`` (``[sequences, time - 1]``)
    and the full log-softmax ``[sequences, time - 1, vocab]`` it was gathered from (float32)."""
    logp_all = torch.log_softmax(logits_of(model(tokens[:, :-1])).float(), dim=-1)
    return logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1), logp_all


def mismatch_stats(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The train-inference mismatch over the tokens where ``mask`` is 1, from ``log r = logp_trainer -
    logp_behaviour``: ``mismatch_abs`` (mean ``|log r|``), ``mismatch_kl`` (mean ``(r - 1) - log r``, the k3
    estimate of KL(behaviour || trainer) from behaviour samples) and ``mismatch_tokens``.

    With no token to measure only ``mismatch_tokens = 0`` is returned: a NaN would be written as the bare
    ``NaN`` that strict JSON readers of ``metrics.jsonl`` refuse.
    """
    n = float(mask.sum())
    if n == 0:
        return {"mismatch_tokens": 0.0}
    log_ratio = log_ratio.detach()
    k3 = torch.expm1(log_ratio) - log_ratio
    return {
        "mismatch_abs": float((log_ratio.abs() * mask).sum() / n),
        "mismatch_kl": float((k3 * mask).sum() / n),
        "mismatch_tokens": n,
    }


def grpo_loss(
    model: nn.Module,
    batch: TokenBatch,
    clip_eps: float,
    entropy_coef: float = 0.0,
    ratio_cap: float | None = DEFAULT_RATIO_CAP,
    current_version: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate loss over completion tokens (minus an optional entropy bonus), and diagnostics.

    Position ``t`` of ``tokens`` is predicted by the logits at ``t - 1``, so the first position (always a
    prompt token) is never scored. The ratio ``r = exp(logp_now - logp_behaviour)`` enters the surrogate as
    ``min(min(r, ratio_cap) * A, clip(r, 1 - clip_eps, 1 + clip_eps) * A)`` (dual clipping): for ``A > 0``
    the cap never binds, for ``A < 0`` a token with ``r > ratio_cap`` contributes ``ratio_cap * A`` and no
    gradient, instead of a term growing with ``r``. Log-ratios above ``LOG_RATIO_LIMIT`` (20) are clamped before
    ``exp``, so even a ``-inf`` behaviour log-prob gives finite figures. The forward pass runs in whatever mode
    the model is in (the trainer's is train mode): a model with dropout adds its noise to the ratio and the
    mismatch.

    Args:
        model: a causal LM (``model(ids)`` returns logits or an output with ``.logits``).
        batch: the batch.
        clip_eps: PPO's trust region.
        entropy_coef: weight of the entropy bonus.
        ratio_cap: the truncation of the unclipped ratio (``None``: none).
        current_version: when given, the mismatch figures of :func:`mismatch_stats` are added, measured on
            the sequences :meth:`TokenBatch.sampled_by` this version.
    """
    logp, logp_all = token_logprobs(model, batch.tokens)
    mask = batch.loss_mask[:, 1:]
    log_ratio = ((logp - batch.behaviour_logprobs[:, 1:]) * mask).clamp(max=LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    adv = batch.advantages[:, None]
    unclipped = ratio if ratio_cap is None else torch.clamp(ratio, max=ratio_cap)
    surrogate = torch.minimum(unclipped * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    n_tokens = mask.sum().clamp(min=1.0)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mean_entropy = (entropy * mask).sum() / n_tokens
    loss = -(surrogate * mask).sum() / n_tokens - entropy_coef * mean_entropy
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
        capped = (ratio > ratio_cap).float() if ratio_cap is not None else torch.zeros_like(ratio)
        stats = {
            "loss": float(loss),
            "clip_fraction": float((clipped * mask).sum() / n_tokens),
            "approx_kl": float((((ratio - 1) - log_ratio) * mask).sum() / n_tokens),
            "entropy": float(mean_entropy),
            "ratio_capped_fraction": float((capped * mask).sum() / n_tokens),
            "ratio_max": float(torch.where(mask > 0, ratio, torch.zeros_like(ratio)).max()),
        }
        if current_version is not None:
            stats |= mismatch_stats(log_ratio, mask * batch.sampled_by(current_version)[:, None])
    return loss, stats
