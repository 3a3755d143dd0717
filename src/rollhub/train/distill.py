"""Teacher distillation in GRPO: a KL term toward a teacher's top-k distribution that an environment sends with
its groups (AtroposLib's ``distill_token_ids`` and ``distill_logprobs``, ``[sequence][position][k]``).

**Alignment.** Entry ``t`` of a sequence's lists is about position ``t`` of its ``tokens``: the teacher's most
likely tokens there and their log-probs, given ``tokens[:t]`` (vLLM's ``prompt_logprobs`` convention, what
Atropos's ``get_logprobs`` returns). An empty list, or a position that is not a completion token (mask
``-100``), adds nothing; so does a group that sends neither field.

**The term.** At each completion position with teacher entries, the teacher's distribution ``q`` is its
log-probs renormalised over the tokens given (a softmax over them: top-k of a larger vocabulary), and

    KL_t = sum_k q_k (log q_k - log p_k)

where ``p_k`` is the student's probability of token ``k`` under its full distribution at temperature 1 (the
model's own, not the sampling distribution). It is zero only when the student puts all its mass on the
teacher's tokens in the teacher's proportions. The GRPO loss adds ``distill_coef`` times its mean over the
distilled positions of the batch (``GRPOConfig.distill_coef``; 0, the default, leaves the fields unread).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollhub.errors import InvalidInput
from rollhub.experience import Group

DISTILL_FIELDS = ("distill_token_ids", "distill_logprobs")


@dataclass(slots=True)
class TeacherTopK:
    """The teacher's top-k of a batch, padded: ``[sequences, time, k]``.

    Attributes:
        ids: token ids (0 where there is no entry).
        logprobs: the teacher's log-probs (``-inf`` where there is no entry).
    """

    ids: torch.Tensor
    logprobs: torch.Tensor


def _rows(group: Group, index: int, name: str) -> list[Any] | None:
    value = group.meta.get(name)
    if not value:
        return None
    if len(value) != group.size:
        raise InvalidInput(f"group {index} has {len(value)} {name} rows for {group.size} sequences", field=name)
    return value


def _entries(group: Group, index: int) -> list[tuple[list[Any], list[Any]]] | None:
    """Per sequence, the ids and log-probs rows, checked to match its tokens; ``None`` when not sent."""
    ids, lps = _rows(group, index, DISTILL_FIELDS[0]), _rows(group, index, DISTILL_FIELDS[1])
    if ids is None and lps is None:
        return None
    if ids is None or lps is None:
        raise InvalidInput(f"group {index} sends only one of {' and '.join(DISTILL_FIELDS)}; send both or neither",
                           field=DISTILL_FIELDS[0] if ids is None else DISTILL_FIELDS[1])  # fmt: skip
    for seq, (length, id_row, lp_row) in enumerate(zip(group.tokens.lengths, ids, lps, strict=True)):
        shapes = [len(a) == len(b) for a, b in zip(id_row, lp_row, strict=False)]
        if len(id_row) != length or len(lp_row) != length or not all(shapes):
            raise InvalidInput(
                f"group {index} sequence {seq}: distill_token_ids and distill_logprobs need one list per token "
                f"({int(length)}), the two of equal length at every position",
                field=DISTILL_FIELDS[0],
                index=index,
            )
    return list(zip(ids, lps, strict=True))


def teacher_topk(groups: Sequence[Group], width: int) -> TeacherTopK | None:
    """The teacher entries of ``groups`` laid out like the batch's tokens (right-padded to ``width``); ``None``
    when no group sends any.

    Raises:
        InvalidInput: a group's rows do not match its tokens (the message names the group and the field).
    """
    per_group = [_entries(g, i) for i, g in enumerate(groups)]
    k = max((len(pos) for e in per_group if e for ids, _ in e for pos in ids), default=0)
    if k == 0:
        return None
    n = sum(g.size for g in groups)
    ids = np.zeros((n, width, k), dtype=np.int64)
    lps = np.full((n, width, k), -np.inf, dtype=np.float32)
    row = 0
    for group, entries in zip(groups, per_group, strict=True):
        for seq in range(group.size):
            for t, (pos_ids, pos_lps) in enumerate(zip(*entries[seq], strict=True) if entries else ()):
                ids[row, t, : len(pos_ids)] = pos_ids
                lps[row, t, : len(pos_lps)] = pos_lps
            row += 1
    return TeacherTopK(torch.from_numpy(ids), torch.from_numpy(lps))


def teacher_kl(teacher: torch.Tensor, student: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, ``KL(q || p)`` over the teacher's tokens (see the module docstring) and whether the position
    has any teacher entry.

    Args:
        teacher: ``[positions, k]`` teacher log-probs (``-inf``: no entry).
        student: ``[positions, k]`` the student's log-probs of the same tokens (full distribution).
    """
    given = torch.isfinite(teacher)
    has = given.any(-1)
    log_q = torch.log_softmax(torch.where(has[:, None], teacher, 0.0), -1)  # all -inf would be NaN
    kl = torch.where(given, log_q.exp() * (log_q - student), 0.0).sum(-1)
    return torch.where(has, kl, 0.0), has
