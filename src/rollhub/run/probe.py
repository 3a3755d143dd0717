"""The train-inference mismatch of a Hugging Face run, measured after every update at equal weights.

After update ``v`` the trainer holds version ``v`` and has just pushed it into the engines, so both sides compute
the same distribution: :func:`probe_mismatch` takes a fixed set of sequences (the newest held-out evaluation's
completions), asks the engine for the log-prob of each completion token (``prompt_logprobs``) and compares it with
the trainer's own, with the figures of :func:`rollhub.train.grpo_loss.mismatch_stats` under the names
``probe_mismatch_abs``, ``probe_mismatch_kl`` and ``probe_tokens``. Unlike the trainer's ``mismatch_*`` (taken
on the batch, only over groups the current weights sampled), it measures every update, however stale the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rollhub.envs.group.scored import PROMPT_MASK
from rollhub.experience import Group
from rollhub.train.grpo_loss import mismatch_stats, token_logprobs

PROBE_SEQUENCES = 16
_NAMES = {"mismatch_abs": "probe_mismatch_abs", "mismatch_kl": "probe_mismatch_kl", "mismatch_tokens": "probe_tokens"}


def probe_sequences(groups: Sequence[Group], limit: int = PROBE_SEQUENCES) -> list[tuple[list[int], list[bool]]]:
    """Up to ``limit`` sequences of ``groups``: token ids and which positions are completion tokens."""
    out = []
    for group in groups:
        for tokens, mask in zip(group.tokens.rows(), group.masks.rows(), strict=True):
            if len(out) < limit and len(tokens) > 1:
                out.append(([int(t) for t in tokens], [int(m) != PROMPT_MASK for m in mask]))
    return out


def probe_mismatch(model: Any, client: Any, probe: list[tuple[list[int], list[bool]]]) -> dict[str, float]:
    """The mismatch between ``model`` (the trainer's copy) and the engine behind ``client`` on ``probe``."""
    if not probe:
        return {}
    engine = client.score([tokens for tokens, _ in probe])
    width = max(len(tokens) for tokens, _ in probe)
    ids = torch.zeros((len(probe), width), dtype=torch.long)
    theirs = torch.zeros((len(probe), width - 1))
    mask = torch.zeros((len(probe), width - 1))
    for i, ((tokens, completion), scored) in enumerate(zip(probe, engine, strict=True)):
        ids[i, : len(tokens)] = torch.tensor(tokens)
        for t in range(1, len(tokens)):
            if completion[t] and scored[t] is not None:
                theirs[i, t - 1], mask[i, t - 1] = scored[t], 1.0
    with torch.no_grad():
        mine, _ = token_logprobs(model, ids)
    stats = mismatch_stats((mine - theirs) * mask, mask)
    return {_NAMES[k]: v for k, v in stats.items()}
