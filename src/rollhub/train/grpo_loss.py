"""The GRPO batch and loss: groups flattened to padded tensors, group-relative advantages, log-probs of the
distribution that sampled each token, the clipped surrogate with a named off-policy correction, and the
train-inference mismatch figures taken from the same forward pass.

:mod:`rollhub.train.grpo` (the trainer) re-exports everything public here.

The model is any causal LM called as ``model(token_ids)``: the built-in
:class:`~rollhub.inference.torch_policy.TinyTransformer` returns the logits tensor, a Hugging Face
``AutoModelForCausalLM`` an output object with ``.logits`` (:func:`rollhub.models.hf.logits_of` takes either).
Batches are right-padded, so a causal model needs no attention mask: padding only ever follows the positions
that are scored.

**Which distribution every log-prob is of.** Each group records the settings it was sampled with in
``generation_params`` (temperature, top-p, top-k, min-p; :func:`rollhub.envs.group.scored.make_group` writes
them), and :func:`sampled_logprobs` computes the trainer's log-probs of that same distribution: logits divided by
the temperature and truncated to the same support, renormalised
(:func:`rollhub.models.sampling.processed_logits`). The behaviour log-probs are the sampler's of the same
distribution (vLLM with ``--logprobs-mode processed_logprobs``, the local policy by construction). A group with
no ``generation_params`` is taken to be sampled at :class:`TokenBatch`'s default distribution (the trainer's
``GRPOConfig.sampling``), a group sampled greedily or with a history-dependent penalty is refused.

**What a group may leave out** (an Atropos environment's ``ScoredData`` often does):

- ``inference_logprobs``: the group's behaviour log-probs are taken to be the trainer's own at the start of the
  update (the proximal log-probs, computed by the same forward pass as the loss): the on-policy assumption. Its
  tokens then get importance weight 1 under every correction and PPO's ratio is taken against the proximal
  policy, so nothing corrects for the engine having sampled them with other (older) weights or other kernels;
  they count in ``recomputed_fraction`` and are left out of the ``mismatch_*`` figures.
- ``advantages``: GRPO's group-relative advantage of each sequence applies to its every completion token. A group
  that carries ``advantages`` (one row per sequence, as long as its token row) uses them instead, token by token,
  as given (no normalisation); they count in ``env_advantage_fraction``.
- ``overrides``: a sequence whose entry sets ``set_advantage_to_zero`` gets advantage 0 (GRPO's and its own),
  as Atropos's example trainer does; other override keys are not read.
- ``distill_token_ids`` / ``distill_logprobs``: a teacher's top-k per position; with ``distill_coef`` > 0 they
  add a KL term toward the teacher (:mod:`rollhub.train.distill`), otherwise they are not read.

**Memory.** Only completion positions get logits, and they are computed ``chunk_elements`` logits at a time
(positions x vocabulary), each block recomputed in the backward pass instead of kept: a 151,936-token vocabulary
trains without the ``[sequences, time, vocab]`` tensor ever existing (docs/llm.md has the measured figures).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rollhub.errors import InvalidInput
from rollhub.experience import Group, Ragged
from rollhub.experience.episodes import episode_index, first_rows
from rollhub.experience.group import PROMPT_MASK
from rollhub.models.hf import logits_of, output_head
from rollhub.models.sampling import Distribution, processed_logits
from rollhub.train.distill import TeacherTopK, teacher_kl, teacher_topk
from rollhub.train.offpolicy import (
    PRESETS,
    Correction,
    clamp_log_ratio,
    correction_weights,
    ess_fraction,
)

UNVERSIONED = -1  # TokenBatch.policy_versions of a group without a policy_version
DEFAULT_DUAL_CLIP = 3.0
DEFAULT_CHUNK_ELEMENTS = 1 << 25  # logits per block: 32M floats, 128 MiB (about 220 positions of a 152k vocabulary)


@dataclass(slots=True)
class TokenBatch:
    """A batch of groups flattened to padded tensors ``[sequences, time]``.

    Attributes:
        tokens: token ids, right-padded with 0.
        loss_mask: 1.0 where a completion token is predicted (position ``t`` predicts ``tokens[t]``).
        behaviour_logprobs: stored log-prob of ``tokens[t]`` where ``loss_mask`` is 1, else 0.
        advantages: one group-relative advantage per sequence.
        policy_versions: the policy version that produced each sequence (``-1``: unversioned).
        recorded: ``[sequences]``: 1.0 where the group sent behaviour log-probs, 0.0 where the trainer's proximal
            log-probs stand in for them (see the module docstring).
        env_advantages: ``[sequences, time]``: the advantage the group sent for each token (0 elsewhere).
        from_env: ``[sequences]``: 1.0 where ``env_advantages`` replace GRPO's for the sequence, else 0.0.
        teacher: the teacher's top-k for the distillation term (:mod:`rollhub.train.distill`), or ``None``.
        temperature, top_p, top_k, min_p: ``[sequences]``: the distribution each sequence was sampled from.
        proximal_logprobs: the trainer's log-probs ``[sequences, time - 1]`` before any step on this batch (set by
            the trainer's first epoch; ``None`` until then).
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    policy_versions: np.ndarray
    recorded: torch.Tensor
    env_advantages: torch.Tensor
    from_env: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    teacher: TeacherTopK | None = None
    proximal_logprobs: torch.Tensor | None = None

    def token_advantages(self) -> torch.Tensor:
        """``[sequences, time - 1]``: the advantage of the token each position predicts (GRPO's per sequence, or
        the group's own per token)."""
        grpo = self.advantages[:, None].expand(-1, self.tokens.shape[1] - 1)
        return torch.where(self.from_env[:, None] > 0, self.env_advantages[:, 1:], grpo)

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


def _sent(rows: Ragged | None) -> bool:
    """Whether a per-token field was sent (``None`` and ``[]`` were not)."""
    return rows is not None and rows.n_rows > 0


def sequence_advantages(group: Group, eps: float = 1e-4) -> np.ndarray:
    """One advantage per row. Rows that name their episodes (multi-turn groups, :mod:`rollhub.experience.episodes`)
    compare episodes, not rows: one score per episode, and every row of an episode gets its episode's advantage, so
    an episode whose template forked it into several rows counts once in the group's mean and spread."""
    index = episode_index(group)
    if index is None:
        return group_advantages(group.scores, eps)
    return group_advantages(group.scores[first_rows(index)], eps)[index]


def _check_group(i: int, group: Group) -> None:
    lengths = group.tokens.lengths
    for name in ("masks", "inference_logprobs", "advantages"):
        rows = getattr(group, name)
        if name != "masks" and not _sent(rows):
            continue
        if rows.n_rows != group.size or not np.array_equal(rows.lengths, lengths):
            raise InvalidInput(
                f"group {i} has {name} rows that do not match its token rows; send one row per sequence, as long "
                f"as the sequence (or leave {name} out)",
                field=name,
                index=i,
            )


def group_distribution(i: int, group: Group, default: Distribution) -> Distribution:
    """The distribution group ``i`` was sampled from: its ``generation_params``, else ``default``.

    Raises:
        InvalidInput: the settings were greedy, carry a history-dependent penalty, or are out of range.
    """
    params = group.meta.get("generation_params")
    if not isinstance(params, dict):
        return default
    return Distribution.from_params(params, where=f"group {i} generation_params")


def groups_to_batch(groups: list[Group], eps: float = 1e-4, default: Distribution | None = None,
                    distill: bool = False) -> TokenBatch:  # fmt: skip
    """Flatten groups into a :class:`TokenBatch` (advantages computed per group, distributions read per group;
    with ``distill``, the teacher's top-k the groups send).

    Only positions whose mask is not ``-100`` train, wherever they are in a row: a multi-turn row holds several
    sampled spans with environment tokens between them.

    Raises:
        InvalidInput: a group's masks, log-probs, advantages or teacher entries do not match its token rows, or
            it was sampled with settings the trainer cannot reproduce (see :func:`group_distribution`).
    """
    default = default or Distribution()
    dists = []
    for i, group in enumerate(groups):
        _check_group(i, group)
        dists += [group_distribution(i, group, default)] * group.size
    lengths = np.concatenate([g.tokens.lengths for g in groups])
    n, width = len(lengths), int(lengths.max())
    rows = np.repeat(np.arange(n), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    cols = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
    flat_mask = np.concatenate([g.masks.data for g in groups]) != PROMPT_MASK
    flat_lp = _flat(groups, "inference_logprobs")
    flat_adv = _flat(groups, "advantages")
    tokens = np.zeros((n, width), dtype=np.int64)
    loss_mask = np.zeros((n, width), dtype=np.float32)
    behaviour = np.zeros((n, width), dtype=np.float32)
    env_advantages = np.zeros((n, width), dtype=np.float32)
    tokens[rows, cols] = np.concatenate([g.tokens.data for g in groups])
    loss_mask[rows, cols] = flat_mask
    behaviour[rows, cols] = np.where(flat_mask, flat_lp, 0.0)
    env_advantages[rows, cols] = np.where(flat_mask, flat_adv, 0.0)
    env_advantages[np.concatenate([_zeroed(g) for g in groups])] = 0.0
    versions = [np.full(g.size, UNVERSIONED if g.policy_version is None else g.policy_version) for g in groups]
    return TokenBatch(
        tokens=torch.from_numpy(tokens),
        loss_mask=torch.from_numpy(loss_mask),
        behaviour_logprobs=torch.from_numpy(behaviour),
        advantages=torch.from_numpy(np.concatenate([_advantages(g, eps) for g in groups])).float(),
        policy_versions=np.concatenate(versions),
        recorded=_per_sequence(groups, "inference_logprobs"),
        env_advantages=torch.from_numpy(env_advantages),
        from_env=_per_sequence(groups, "advantages"),
        temperature=torch.tensor([d.temperature for d in dists], dtype=torch.float32),
        top_p=torch.tensor([d.top_p for d in dists], dtype=torch.float32),
        top_k=torch.tensor([max(d.top_k, 0) for d in dists], dtype=torch.long),
        min_p=torch.tensor([d.min_p for d in dists], dtype=torch.float32),
        teacher=teacher_topk(groups, width) if distill else None,
    )


def _zeroed(group: Group) -> np.ndarray:
    """``[size]``: True for the sequences whose ``overrides`` entry sets ``set_advantage_to_zero`` (Atropos)."""
    overrides = group.meta.get("overrides") or []
    flags = [isinstance(o, dict) and bool(o.get("set_advantage_to_zero")) for o in overrides]
    return np.array(flags if len(flags) == group.size else [False] * group.size, dtype=bool)


def _advantages(group: Group, eps: float) -> np.ndarray:
    """GRPO's advantage of each sequence of ``group`` (by episode: :func:`sequence_advantages`), 0 where an
    override zeroes it."""
    return np.where(_zeroed(group), 0.0, sequence_advantages(group, eps))


def _flat(groups: list[Group], name: str) -> np.ndarray:
    """A per-token field of every group, flat, with zeros for groups that did not send it."""
    parts = []
    for group in groups:
        rows = getattr(group, name)
        parts.append(rows.data if _sent(rows) else np.zeros(group.n_tokens))
    return np.concatenate(parts).astype(np.float64, copy=False)


def _per_sequence(groups: list[Group], name: str) -> torch.Tensor:
    """``[sequences]``: 1.0 for the sequences of groups that sent the per-token field ``name``, else 0.0."""
    flags = [np.full(g.size, float(_sent(getattr(g, name))), dtype=np.float32) for g in groups]
    return torch.from_numpy(np.concatenate(flags))


@dataclass(slots=True)
class SampledLogprobs:
    """The trainer's log-probs of the sampled tokens under the distribution that sampled them.

    Attributes:
        logprobs: ``[sequences, time - 1]``: log-prob of ``tokens[:, t + 1]``; 0 off the completion positions and
            where the token lies outside the trainer's support.
        entropy: ``[sequences, time - 1]``: entropy of that distribution at each completion position, else 0.
        in_support: ``[sequences, time - 1]``: 1.0 at completion positions whose token the trainer's truncated
            distribution keeps (always all of them without truncation).
        distill_kl: ``[sequences, time - 1]``: the KL to the teacher at each completion position (with gradient;
            :func:`rollhub.train.distill.teacher_kl`), 0 elsewhere; ``None`` when the batch has no teacher.
        distilled: ``[sequences, time - 1]``: 1.0 where ``distill_kl`` is measured; ``None`` likewise.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    in_support: torch.Tensor
    distill_kl: torch.Tensor | None = None
    distilled: torch.Tensor | None = None


def _block(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
           temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
           teacher_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Log-prob of ``targets`` and entropy for one block of positions ``[n, hidden]`` -> ``[n]``, ``[n]``; with
    ``teacher_ids`` ``[n, k]`` also the model's own (temperature 1, untruncated) log-probs of them, ``[n, k]``."""
    logits = logits_of(head(hidden))
    logp_all = torch.log_softmax(processed_logits(logits, temperature, top_k, top_p, min_p), dim=-1)
    # dropped tokens have p = 0 and log p = -inf: 0 * -inf would be NaN, in the value and in the gradient
    entropy = -(logp_all.exp() * torch.where(torch.isfinite(logp_all), logp_all, 0.0)).sum(-1)
    picked = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    if teacher_ids is None:
        return picked, entropy
    return picked, entropy, torch.log_softmax(logits.float(), dim=-1).gather(-1, teacher_ids)


def sampled_logprobs(model: nn.Module, batch: TokenBatch,
                     chunk_elements: int | None = DEFAULT_CHUNK_ELEMENTS) -> SampledLogprobs:  # fmt: skip
    """One forward pass: the log-prob of each completion token under each sequence's sampling distribution.

    With ``chunk_elements``, only the completion positions go through the output head, ``chunk_elements`` logits
    at a time, each block recomputed in the backward pass (when gradients are on and there is more than one
    block); ``None`` computes the whole ``[sequences, time - 1, vocab]`` logits at once (the reference the
    chunked path is tested against). A model whose logits are not ``head(hidden)`` always takes the whole path.
    """
    mask = batch.loss_mask[:, 1:] > 0
    rows, cols = mask.nonzero(as_tuple=True)
    targets = batch.tokens[:, 1:][rows, cols]
    split = output_head(model) if chunk_elements is not None else None
    if split is None:
        hidden, head = logits_of(model(batch.tokens[:, :-1])), nn.Identity()
    else:
        body, head = split
        hidden = body(batch.tokens[:, :-1])
    picked = hidden[rows, cols]
    settings = [batch.temperature[rows], batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]]
    if batch.teacher is not None:
        settings.append(batch.teacher.ids[:, 1:][rows, cols])
    vocab = int(getattr(head, "out_features", 0) or picked.shape[-1])
    step = max(1, len(rows) if chunk_elements is None else chunk_elements // max(vocab, 1))
    recompute = torch.is_grad_enabled() and len(rows) > step
    parts = []
    for lo in range(0, len(rows), step):
        args = (head, picked[lo : lo + step], targets[lo : lo + step], *(s[lo : lo + step] for s in settings))
        parts.append(checkpoint(_block, *args, use_reentrant=False) if recompute else _block(*args))
    flat_logp = torch.cat([p[0] for p in parts]) if parts else picked.new_zeros(0)
    flat_entropy = torch.cat([p[1] for p in parts]) if parts else picked.new_zeros(0)
    kept = torch.isfinite(flat_logp)
    shape = (batch.tokens.shape[0], batch.tokens.shape[1] - 1)
    logprobs = torch.zeros(shape, dtype=torch.float32).index_put((rows, cols), torch.where(kept, flat_logp, 0.0))
    entropy = torch.zeros(shape, dtype=torch.float32).index_put((rows, cols), flat_entropy.float())
    in_support = torch.zeros(shape, dtype=torch.float32).index_put((rows, cols), kept.float())
    out = SampledLogprobs(logprobs, entropy, in_support)
    if batch.teacher is not None:
        student = torch.cat([p[2] for p in parts]) if parts else picked.new_zeros(0, batch.teacher.ids.shape[-1])
        kl, has = teacher_kl(batch.teacher.logprobs[:, 1:][rows, cols], student)
        out.distill_kl = torch.zeros(shape, dtype=torch.float32).index_put((rows, cols), kl.float())
        out.distilled = torch.zeros(shape, dtype=torch.float32).index_put((rows, cols), has.float())
    return out


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
    log_ratio = clamp_log_ratio(log_ratio.detach() * mask)
    k3 = torch.expm1(log_ratio) - log_ratio
    return {
        "mismatch_abs": float((log_ratio.abs() * mask).sum() / n),
        "mismatch_kl": float((k3 * mask).sum() / n),
        "mismatch_tokens": n,
    }


def _share(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """The fraction of ``mask``'s tokens where ``flags`` holds (0 when there are none)."""
    n = float(mask.sum())
    return float((flags.float() * mask).sum() / n) if n else 0.0


def grpo_loss(
    model: nn.Module,
    batch: TokenBatch,
    clip_eps: float,
    entropy_coef: float = 0.0,
    correction: Correction = PRESETS["ppo"],
    dual_clip: float | None = DEFAULT_DUAL_CLIP,
    current_version: int | None = None,
    chunk_elements: int | None = DEFAULT_CHUNK_ELEMENTS,
    distill_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate loss over completion tokens (minus an optional entropy bonus), and diagnostics.

    Position ``t`` of ``tokens`` is predicted by the logits at ``t - 1``, so the first position (always a prompt
    token) is never scored. With ``pi`` the log-probs of :func:`sampled_logprobs`, ``mu`` the behaviour log-probs
    and ``prox`` the batch's ``proximal_logprobs`` (the first call sets them to ``pi`` detached), every
    completion token contributes ``w * min(r * A, clip(r, 1 - clip_eps, 1 + clip_eps) * A)``, where
    ``r = exp(pi - anchor)`` with the anchor ``mu`` or ``prox`` and ``w`` the detached weight of ``correction``
    from ``prox - mu`` (:mod:`rollhub.train.offpolicy`). With ``dual_clip = c`` a negative advantage's term is
    bounded below by ``c * A`` (dual-clip PPO: a token whose ratio exploded adds ``c * |A|`` and no gradient).
    Tokens outside the trainer's truncated support have no log-prob to train: they get no weight and are counted.
    The loss is averaged over every completion token of the batch. The model should be in eval mode (no dropout):
    the trainer's is.

    Args:
        model: a causal LM (``model(ids)`` returns logits or an output with ``.logits``).
        batch: the batch.
        clip_eps: PPO's trust region.
        entropy_coef: weight of the entropy bonus (of the sampling distribution).
        correction: the off-policy correction.
        dual_clip: the dual-clip bound (> ``1 + clip_eps``), or ``None``.
        current_version: when given, the mismatch figures of :func:`mismatch_stats` are added, measured on
            the sequences :meth:`TokenBatch.sampled_by` this version.
        chunk_elements: see :func:`sampled_logprobs`.
        distill_coef: weight of the KL to the teacher (:mod:`rollhub.train.distill`), averaged over the
            completion positions the batch's ``teacher`` covers; with no teacher it adds nothing.
    """
    out = sampled_logprobs(model, batch, chunk_elements)
    if batch.proximal_logprobs is None:  # the first pass over the batch: the proximal policy is the current one
        batch.proximal_logprobs = out.logprobs.detach()
    completion = batch.loss_mask[:, 1:]
    mask = completion * out.in_support
    proximal = batch.proximal_logprobs
    recorded = batch.recorded[:, None].expand_as(completion)
    behaviour = torch.where(recorded > 0, batch.behaviour_logprobs[:, 1:], proximal)  # none sent: on-policy
    anchor = behaviour if correction.anchor == "behaviour" else proximal
    log_ratio = clamp_log_ratio((out.logprobs - anchor) * mask)
    ratio = torch.exp(log_ratio)
    log_w = (proximal - behaviour) * mask
    weights, capped, masked = correction_weights(correction, log_w, mask)
    adv = batch.token_advantages()
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    if dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, dual_clip * adv), surrogate)
    n_tokens = completion.sum().clamp(min=1.0)
    mean_entropy = (out.entropy * mask).sum() / n_tokens
    loss = -(weights * surrogate * mask).sum() / n_tokens - entropy_coef * mean_entropy
    distill: dict[str, float] = {}
    if out.distill_kl is not None and out.distilled is not None:
        positions = out.distilled.sum()
        mean_kl = (out.distill_kl * out.distilled).sum() / positions.clamp(min=1.0)
        loss = loss + distill_coef * mean_kl
        distill = {"distill_kl": float(mean_kl.detach()), "distill_positions": float(positions)}
    with torch.no_grad():
        clipped = (ratio - 1).abs() > clip_eps
        w_raw = torch.exp(clamp_log_ratio(log_w))
        stats = {
            "loss": float(loss),
            "clip_fraction": _share(clipped, mask),
            "clip_fraction_pos": _share(clipped, mask * (adv > 0)),
            "clip_fraction_neg": _share(clipped, mask * (adv < 0)),
            "dual_clip_fraction": _share(ratio > dual_clip, mask * (adv < 0)) if dual_clip is not None else 0.0,
            "approx_kl": float((((ratio - 1) - log_ratio) * mask).sum() / n_tokens),
            "entropy": float(mean_entropy),
            "ess_fraction": ess_fraction(log_w, mask),
            "is_ratio_max": float(torch.where(mask > 0, w_raw, torch.zeros_like(w_raw)).max()) if mask.any() else 1.0,
            "capped_fraction": _share(capped, mask),
            "masked_fraction": _share(masked, mask),
            "outside_support_fraction": _share(out.in_support == 0, completion),
            "recomputed_fraction": _share(recorded == 0, completion),
            "env_advantage_fraction": _share(batch.from_env[:, None].expand_as(completion) > 0, completion),
            **distill,
        }
        if current_version is not None:
            measured = mask * recorded * batch.sampled_by(current_version)[:, None]
            stats |= mismatch_stats(proximal - behaviour, measured)
    return loss, stats
