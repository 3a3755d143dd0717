"""GRPO on groups of completions, read top to bottom: batch -> advantages -> clipped loss -> step -> publish.

The trainer consumes scored-data items exactly as the buffer server serves them (``GET /batch``): a list of
dicts with ``tokens``, ``masks`` (``-100`` on prompt positions), ``scores``, ``inference_logprobs`` (``1.0``
on prompt positions) and ``policy_version``. One item is one group of completions of one prompt.

1. Advantages are group-relative: each completion's score minus its group's mean, divided by the group's
   standard deviation (plus ``eps``). A group whose scores are all equal teaches nothing and gets zero.
2. The loss is PPO's clipped surrogate per completion token, with the importance ratio
   ``exp(logp_now - logp_behaviour)`` taken against the stored behaviour log-probs, so data sampled by
   older weights (up to ``max_staleness`` steps) is corrected rather than treated as on-policy.
3. Tokens are averaged over every completion token of the batch (prompt positions never count).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from rollhub.errors import InvalidInput, RollhubError
from rollhub.rollout_types import PROMPT_MASK


class TrainingError(RollhubError):
    """The trainer was given a batch or setting it cannot train on."""


@dataclass(frozen=True, slots=True)
class GRPOConfig:
    """Hyper-parameters of :class:`GRPOTrainer`.

    Attributes:
        lr: Adam learning rate.
        clip_eps: the importance ratio is clipped to ``[1 - clip_eps, 1 + clip_eps]``.
        adv_eps: added to the group standard deviation before dividing.
        max_staleness: items whose ``policy_version`` is more than this many steps behind are dropped.
        epochs: optimizer passes over each batch.
        max_grad_norm: gradients are clipped to this global norm.
        entropy_coef: weight of an entropy bonus on completion tokens (keeps small groups from collapsing
            onto one answer before the reward has told them apart).
        anneal_steps: over this many steps the learning rate and the entropy weight fall along a cosine to
            ``lr_final`` and ``entropy_coef_final`` and stay there (0: both stay constant).
        lr_final: the learning rate after ``anneal_steps`` (None: ``lr``).
        entropy_coef_final: the entropy weight after ``anneal_steps`` (None: ``entropy_coef``).
    """

    lr: float = 3e-3
    clip_eps: float = 0.2
    adv_eps: float = 1e-4
    max_staleness: int = 4
    epochs: int = 1
    max_grad_norm: float = 1.0
    entropy_coef: float = 0.0
    anneal_steps: int = 0
    lr_final: float | None = None
    entropy_coef_final: float | None = None

    def annealed(self, start: float, final: float | None, step: int) -> float:
        """``start`` moved along a half cosine toward ``final`` at ``step`` (see ``anneal_steps``)."""
        if final is None or self.anneal_steps <= 0:
            return start
        done = min(1.0, step / self.anneal_steps)
        return final + (start - final) * 0.5 * (1.0 + math.cos(math.pi * done))


@dataclass(slots=True)
class TokenBatch:
    """A batch of items flattened to padded tensors ``[sequences, time]``.

    Attributes:
        tokens: token ids, right-padded with 0.
        loss_mask: 1.0 where a completion token is predicted (position ``t`` predicts ``tokens[t]``).
        behaviour_logprobs: stored log-prob of ``tokens[t]`` where ``loss_mask`` is 1, else 0.
        advantages: one group-relative advantage per sequence.
        policy_versions: the producing weight step of each sequence.
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    policy_versions: np.ndarray


def group_advantages(scores: np.ndarray, eps: float = 1e-4) -> np.ndarray:
    """``(score - group mean) / (group std + eps)``; zero for a group whose scores are all equal."""
    scores = np.asarray(scores, dtype=np.float64)
    if np.ptp(scores) == 0:  # all equal: no signal (and a std of exactly 0 is not guaranteed by rounding)
        return np.zeros_like(scores)
    return (scores - scores.mean()) / (scores.std() + eps)


def items_to_batch(items: list[dict[str, Any]], eps: float = 1e-4) -> TokenBatch:
    """Flatten server items into a :class:`TokenBatch` (advantages computed per item, i.e. per group).

    Raises:
        InvalidInput: an item lacks ``inference_logprobs`` or has rows of different lengths.
    """
    rows, masks, lps, advs, versions = [], [], [], [], []
    for i, item in enumerate(items):
        if not item.get("inference_logprobs"):
            raise InvalidInput(
                f"item {i} has no inference_logprobs; GRPO needs the behaviour log-probs of every token",
                field="inference_logprobs",
                index=i,
            )
        advs.extend(group_advantages(np.asarray(item["scores"], dtype=np.float64), eps))
        version = item.get("policy_version")
        for toks, mask, lp in zip(item["tokens"], item["masks"], item["inference_logprobs"], strict=True):
            if not len(toks) == len(mask) == len(lp):
                raise InvalidInput(f"item {i} has a row whose tokens, masks and log-probs differ in length")
            rows.append(np.asarray(toks, dtype=np.int64))
            masks.append(np.asarray(mask, dtype=np.int64) != PROMPT_MASK)
            lps.append(np.asarray(lp, dtype=np.float32))
            versions.append(-1 if version is None else int(version))
    width = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), dtype=np.int64)
    loss_mask = np.zeros((len(rows), width), dtype=np.float32)
    behaviour = np.zeros((len(rows), width), dtype=np.float32)
    for j, (r, m, lp) in enumerate(zip(rows, masks, lps, strict=True)):
        tokens[j, : len(r)] = r
        loss_mask[j, : len(r)] = m
        behaviour[j, : len(r)] = np.where(m, lp, 0.0)
    return TokenBatch(
        tokens=torch.from_numpy(tokens),
        loss_mask=torch.from_numpy(loss_mask),
        behaviour_logprobs=torch.from_numpy(behaviour),
        advantages=torch.tensor(advs, dtype=torch.float32),
        policy_versions=np.asarray(versions),
    )


def grpo_loss(
    model: nn.Module, batch: TokenBatch, clip_eps: float, entropy_coef: float = 0.0
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate loss over completion tokens (minus an optional entropy bonus), and diagnostics.

    Position ``t`` of ``tokens`` is predicted by the logits at ``t - 1``, so the first position (always a
    prompt token) is never scored.
    """
    logits = model(batch.tokens[:, :-1]).float()
    target = batch.tokens[:, 1:]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, target[..., None]).squeeze(-1)
    mask = batch.loss_mask[:, 1:]
    log_ratio = (logp - batch.behaviour_logprobs[:, 1:]) * mask
    ratio = torch.exp(log_ratio)
    adv = batch.advantages[:, None]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    n_tokens = mask.sum().clamp(min=1.0)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mean_entropy = (entropy * mask).sum() / n_tokens
    loss = -(surrogate * mask).sum() / n_tokens - entropy_coef * mean_entropy
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
        stats = {
            "loss": float(loss),
            "clip_fraction": float((clipped * mask).sum() / n_tokens),
            "approx_kl": float((((ratio - 1) - log_ratio) * mask).sum() / n_tokens),
            "entropy": float(mean_entropy),
        }
    return loss, stats


class BatchSource(Protocol):
    """Where batches come from: an in-process queue, or ``TrainerClient`` over the buffer server."""

    def next_batch(self) -> list[dict[str, Any]] | None:
        """The next batch of items, or None when none is ready yet."""
        ...


class GRPOTrainer:
    """Owns the model and optimizer; ``step`` trains on one batch of items and bumps ``step_count``.

    Publishing is a callback (``publish(step, state_dict)``) so the same trainer feeds the Ray object store,
    a checkpoint directory or an in-process policy.
    """

    def __init__(
        self,
        model: nn.Module,
        config: GRPOConfig,
        publish: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        self.publish = publish
        self.step_count = 0

    def fresh(self, items: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The items within ``max_staleness`` steps of the current step (unversioned items always pass)."""
        floor = self.step_count - self.config.max_staleness
        return [it for it in items if it.get("policy_version") is None or it["policy_version"] >= floor]

    def step(self, items: list[dict[str, Any]]) -> dict[str, float]:
        """Train on ``items`` (stale ones dropped), publish the new weights, and return metrics.

        Raises:
            TrainingError: every item was too stale to use.
        """
        fresh = self.fresh(items)
        if not fresh:
            raise TrainingError(
                f"all {len(items)} items are more than {self.config.max_staleness} steps behind step "
                f"{self.step_count}; publish weights more often or raise max_staleness"
            )
        batch = items_to_batch(fresh, self.config.adv_eps)
        cfg = self.config
        lr = cfg.annealed(cfg.lr, cfg.lr_final, self.step_count)
        entropy_coef = cfg.annealed(cfg.entropy_coef, cfg.entropy_coef_final, self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        stats: dict[str, float] = {}
        for _ in range(cfg.epochs):
            loss, stats = grpo_loss(self.model, batch, cfg.clip_eps, entropy_coef)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            self.optimizer.step()
        self.model.eval()
        self.step_count += 1
        versions = batch.policy_versions[batch.policy_versions >= 0]
        stats.update(
            grad_norm=float(grad_norm),
            lr=lr,
            entropy_coef=entropy_coef,
            dropped_stale=float(len(items) - len(fresh)),
            mean_staleness=float(self.step_count - 1 - versions.mean()) if versions.size else 0.0,
            mean_score=float(np.mean([s for it in fresh for s in it["scores"]])),
        )
        if self.publish is not None:
            self.publish(self.step_count, {k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return stats

    def pull_and_step(self, source: BatchSource, timeout_s: float = 60.0, poll_s: float = 0.05) -> dict[str, float]:
        """Wait for the next batch from ``source`` (polling every ``poll_s``), then :meth:`step` on it.

        Raises:
            TrainingError: no batch arrived within ``timeout_s``, or every item of it was too stale.
        """
        deadline = time.monotonic() + timeout_s
        while (items := source.next_batch()) is None:
            if time.monotonic() >= deadline:
                raise TrainingError(
                    f"no batch within {timeout_s} s at step {self.step_count}; check that producers are running"
                )
            time.sleep(poll_s)
        return self.step(items)
