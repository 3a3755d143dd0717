"""Off-policy correction: how the GRPO loss treats tokens sampled by weights other than the ones it trains.

Three log-probs meet in the loss for every completion token:

- ``behaviour`` (mu): what the sampler reported, the distribution the token was drawn from;
- ``proximal`` (pi_prox): the trainer's own log-prob at the start of the update, before any step on the batch
  (detached; with one epoch it is the same forward pass as the loss's, so it costs nothing);
- ``current`` (pi_theta): the trainer's log-prob now, which the gradient flows through.

A :class:`Correction` makes two choices, each named:

``anchor``: what PPO's ratio is taken against. ``"behaviour"``: ``r = pi_theta / mu`` (plain PPO with the sampler
as the old policy: a stale token's ratio starts far from 1 and is clipped before it can teach anything).
``"proximal"``: ``r = pi_theta / pi_prox`` (decoupled PPO: the trust region is around the policy being trained,
whatever sampled the data).

``weight``: a detached per-token factor on the surrogate, computed from ``log w = pi_prox - mu``:

- ``none``: 1 (the proximal anchor then ignores the behaviour policy: biased when data is stale)
- ``token_tis``: ``min(w, cap)``: truncated importance sampling per token
- ``token_mask``: ``1`` if ``low <= w <= high`` else ``0``: drop tokens far off-policy (IcePop)
- ``seq_tis``: ``min(prod w, cap)`` over the sequence's completion tokens, on each of its tokens
- ``seq_mask``: ``1`` if ``low <= prod w <= high`` else ``0``, per sequence
- ``geo_mask``: ``1`` if ``low <= exp(mean log w) <= high`` else ``0``, per sequence (geometric mean)

:data:`PRESETS` name the common settings (see the table in docs/llm.md for where their numbers come from). The
functions here are pure: tensors in, tensors out, nothing learned.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from rollhub.errors import InvalidInput

Anchor = Literal["behaviour", "proximal"]
WeightKind = Literal["none", "token_tis", "token_mask", "seq_tis", "seq_mask", "geo_mask"]
LOG_RATIO_LIMIT = 20.0  # log-ratios are clamped here before exp, so an absurd log-prob stays finite
_BOUNDED = ("token_mask", "seq_mask", "geo_mask")
_CAPPED = ("token_tis", "seq_tis")


@dataclass(frozen=True, slots=True)
class Correction:
    """One off-policy correction (see the module docstring).

    Attributes:
        name: the preset name, or ``"custom"``.
        anchor: what PPO's ratio is taken against.
        weight: the detached per-token factor.
        cap: the truncation of ``token_tis`` and ``seq_tis`` (> 0).
        low, high: the bounds of the masks (``0 <= low < high``).
    """

    name: str
    anchor: Anchor = "proximal"
    weight: WeightKind = "token_tis"
    cap: float = 2.0
    low: float = 0.5
    high: float = 5.0

    def __post_init__(self) -> None:
        if self.anchor not in ("behaviour", "proximal"):
            raise InvalidInput(f"correction anchor {self.anchor!r} is not 'behaviour' or 'proximal'", field="anchor")
        if self.weight not in ("none", *_CAPPED, *_BOUNDED):
            raise InvalidInput(f"correction weight {self.weight!r} is unknown; use one of {WEIGHTS}", field="weight")
        if self.anchor == "behaviour" and self.weight != "none":
            raise InvalidInput(
                "a behaviour anchor already weights every token by pi/mu through PPO's ratio; a further "
                f"{self.weight!r} weight would count it twice: use anchor 'proximal'",
                field="weight",
            )
        if not self.cap > 0:
            raise InvalidInput(f"correction cap {self.cap} must be > 0", field="cap")
        if not 0 <= self.low < self.high:
            raise InvalidInput(f"correction bounds [{self.low}, {self.high}] must have 0 <= low < high", field="low")

    def with_values(self, cap: float | None = None, bounds: tuple[float, float] | None = None) -> Correction:
        """This correction with its ``cap`` and/or ``(low, high)`` replaced (named ``"custom"`` when changed)."""
        changed = {}
        if cap is not None:
            changed["cap"] = cap
        if bounds is not None:
            changed["low"], changed["high"] = bounds
        return replace(self, name=f"{self.name}*", **changed) if changed else self


WEIGHTS: tuple[str, ...] = ("none", *_CAPPED, *_BOUNDED)

PRESETS: dict[str, Correction] = {
    # plain PPO against the sampler's log-probs: the behaviour policy is PPO's old policy (AReaL's baseline)
    "ppo": Correction("ppo", anchor="behaviour", weight="none"),
    # ignore the sampler: treat every token as if the trainer's weights had drawn it (the biased baseline)
    "none": Correction("none", anchor="proximal", weight="none"),
    # token-level truncated importance sampling, C = 2 (verl, slime, SkyRL)
    "tis": Correction("tis", weight="token_tis", cap=2.0),
    # token masking outside [0.5, 5] (IcePop)
    "icepop": Correction("icepop", weight="token_mask", low=0.5, high=5.0),
    # sequence-level truncated importance sampling, C = 5 (SkyRL)
    "seq_tis": Correction("seq_tis", weight="seq_tis", cap=5.0),
    # sequence masking outside [0.2, 5] of the whole sequence's ratio
    "seq_mask": Correction("seq_mask", weight="seq_mask", low=0.2, high=5.0),
    # geometric-mean sequence mask [0.99, 1.01]
    "geo_mask": Correction("geo_mask", weight="geo_mask", low=0.99, high=1.01),
    # decoupled PPO (AReaL): proximal anchor, behaviour weight truncated at 5
    "decoupled": Correction("decoupled", weight="token_tis", cap=5.0),
}
DEFAULT_PRESET = "tis"


def preset(name: str) -> Correction:
    """The preset called ``name``.

    Raises:
        InvalidInput: no such preset; the message lists them.
    """
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise InvalidInput(f"correction {name!r} is not a preset; use one of {known}", field="correction") from None


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``log_ratio`` limited to ``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]`` (so ``exp`` stays finite)."""
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def token_tis(log_w: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min(w, cap), w > cap)`` per token."""
    w = torch.exp(clamp_log_ratio(log_w))
    return w.clamp(max=cap), w > cap


def token_mask(log_w: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """1.0 where ``low <= w <= high``, else 0.0, per token."""
    w = torch.exp(clamp_log_ratio(log_w))
    return ((w >= low) & (w <= high)).float()


def sequence_log_ratio(log_w: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, mean)`` of ``log_w`` over each row's masked tokens, as ``[rows, 1]`` columns (mean 0 on empty rows)."""
    total = (log_w * mask).sum(dim=-1, keepdim=True)
    return total, total / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)


def seq_tis(log_w: torch.Tensor, mask: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min(prod w, cap), prod w > cap)`` of each row, repeated on its tokens."""
    total, _ = sequence_log_ratio(log_w, mask)
    w = torch.exp(clamp_log_ratio(total))
    return w.clamp(max=cap).expand_as(log_w), (w > cap).expand_as(log_w)


def seq_mask(log_w: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """1.0 on the tokens of rows whose ``prod w`` lies in ``[low, high]``, else 0.0."""
    total, _ = sequence_log_ratio(log_w, mask)
    return token_mask(total, low, high).expand_as(log_w)


def geo_mask(log_w: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """1.0 on the tokens of rows whose geometric-mean ratio ``exp(mean log w)`` lies in ``[low, high]``."""
    _, mean = sequence_log_ratio(log_w, mask)
    return token_mask(mean, low, high).expand_as(log_w)


def correction_weights(
    correction: Correction, log_w: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The detached weights of ``correction`` for ``log_w = proximal - behaviour`` ``[rows, time]``.

    Returns:
        ``(weights, capped, masked)``: the factor on each token's surrogate, and boolean tensors of the tokens
        whose weight was truncated or masked to 0 (both restricted to ``mask``).
    """
    log_w = log_w.detach()
    kind, on = correction.weight, mask > 0
    none = torch.zeros_like(on)
    if kind == "none":
        return torch.ones_like(log_w), none, none
    if kind == "token_tis":
        w, capped = token_tis(log_w, correction.cap)
        return w, capped & on, none
    if kind == "seq_tis":
        w, capped = seq_tis(log_w, mask, correction.cap)
        return w, capped & on, none
    if kind == "token_mask":
        w = token_mask(log_w, correction.low, correction.high)
    elif kind == "seq_mask":
        w = seq_mask(log_w, mask, correction.low, correction.high)
    else:
        w = geo_mask(log_w, mask, correction.low, correction.high)
    return w, none, (w == 0) & on


def ess_fraction(log_w: torch.Tensor, mask: torch.Tensor) -> float:
    """The effective sample size of the importance weights ``w`` over the masked tokens, as a fraction of their
    count: ``(sum w)^2 / (n sum w^2)``; 1 when every weight is equal (on-policy), towards ``1/n`` when one dominates.
    """
    n = float(mask.sum())
    if n == 0:
        return 1.0
    w = torch.exp(clamp_log_ratio(log_w.detach())) * mask
    # scale by the largest weight first: the ratio is unchanged and nothing overflows
    w = w / w.max().clamp(min=1e-30)
    return float(w.sum() ** 2 / (n * (w**2).sum()).clamp(min=1e-30))
