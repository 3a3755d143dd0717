"""The train-inference mismatch of a Hugging Face run, measured after every update at equal weights.

After update ``v`` the trainer holds version ``v`` and has just pushed it into the engines, so both sides hold
the same weights. :func:`probe_mismatch` has the engine *sample* one completion of each of a fixed set of prompts
(those of the newest held-out evaluation) at the sampling settings the newest training batch was drawn with, and
compares the engine's log-prob of every sampled token (of the distribution it was drawn from) with the trainer's
log-prob of the same token under the same distribution (:func:`rollhub.train.grpo_loss.sampled_logprobs`). The
figures of :func:`rollhub.train.grpo_loss.mismatch_stats` come out as ``probe_mismatch_abs``,
``probe_mismatch_kl`` and ``probe_tokens``. Since the tokens are drawn from the engine's distribution, the k3
figure is an estimate of KL(engine || trainer). Unlike the trainer's ``mismatch_*`` (taken on the batch, only over
groups the current weights sampled), it measures every update, however stale the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from rollhub.envs.group.scored import make_group
from rollhub.experience import Group
from rollhub.experience.group import PROMPT_MASK
from rollhub.inference.base import SamplingParams
from rollhub.models.sampling import Distribution
from rollhub.train.grpo_loss import DEFAULT_CHUNK_ELEMENTS, groups_to_batch, mismatch_stats, sampled_logprobs

PROBE_PROMPTS = 16
PROBE_MAX_TOKENS = 16  # completion length when the training batch recorded none
_NAMES = {"mismatch_abs": "probe_mismatch_abs", "mismatch_kl": "probe_mismatch_kl", "mismatch_tokens": "probe_tokens"}


def probe_prompts(groups: Sequence[Group], limit: int = PROBE_PROMPTS) -> list[list[int]]:
    """The prompt token ids of up to ``limit`` sequences of ``groups``: each row's positions masked as prompt
    before its first sampled token. An episode's row masks more than its prompt (the tool results and template
    tokens between turns), but only its opening is a prompt the engine was ever asked to continue."""
    out = []
    for group in groups:
        for tokens, mask in zip(group.tokens.rows(), group.masks.rows(), strict=True):
            sampled = np.flatnonzero(np.asarray(mask) != PROMPT_MASK)
            opening = int(sampled[0]) if len(sampled) else len(tokens)
            prompt = [int(t) for t in tokens[:opening]]
            if len(out) < limit and prompt:
                out.append(prompt)
    return out


def probe_params(generation_params: Mapping[str, Any] | None) -> SamplingParams:
    """The settings the probe samples with: those of the newest training batch (temperature 1 before any)."""
    params = dict(generation_params or {})
    dist = Distribution.from_params(params, where="the training batch's generation_params")
    return SamplingParams(
        max_tokens=int(params.get("max_tokens") or PROBE_MAX_TOKENS),
        temperature=dist.temperature, top_p=dist.top_p, top_k=dist.top_k, min_p=dist.min_p,
    )  # fmt: skip


def probe_mismatch(model: Any, client: Any, prompts: list[list[int]], params: SamplingParams,
                   chunk_elements: int | None = DEFAULT_CHUNK_ELEMENTS) -> dict[str, float]:  # fmt: skip
    """The mismatch between ``model`` (the trainer's copy) and the engine behind ``client`` on completions the
    engine samples now from ``prompts`` at ``params``."""
    if not prompts:
        return {}
    completions = client.complete(prompts, 1, replace(params, stop_eos=True), np.random.default_rng(0))
    groups = [make_group("probe", str(i), comps, [0.0] * len(comps), [False] * len(comps))
              for i, comps in enumerate(completions)]  # fmt: skip
    batch = groups_to_batch(groups)
    with torch.no_grad():
        mine = sampled_logprobs(model, batch, chunk_elements)
    mask = batch.loss_mask[:, 1:] * mine.in_support
    stats = mismatch_stats(mine.logprobs - batch.behaviour_logprobs[:, 1:], mask)
    out = {_NAMES[k]: v for k, v in stats.items()}
    out["probe_outside_support"] = float((batch.loss_mask[:, 1:] * (1 - mine.in_support)).sum())
    return out
