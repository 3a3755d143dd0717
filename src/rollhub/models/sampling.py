"""The distribution a token is sampled from, given a model's logits and the sampling settings.

One definition serves the engine's side and the trainer's: :class:`Distribution` holds the settings that shape the
distribution (temperature, min-p, top-k, top-p) and :func:`processed_logits` applies them to a block of logits in
the order vLLM's sampler does:

1. divide by ``temperature``;
2. min-p: drop tokens whose probability is below ``min_p`` times the most likely token's;
3. top-k: keep the tokens whose logit is at least the ``top_k``-th largest (ties kept);
4. top-p: sorted by probability, drop the least likely tokens whose cumulative mass stays at or below
   ``1 - top_p`` (the most likely token is always kept).

Dropped tokens get ``-inf``, so ``log_softmax`` of the result is renormalised over the kept support: these are the
log-probs vLLM returns with ``--logprobs-mode processed_logprobs``, the ones the local policy stores, and the ones
the trainer computes (:func:`rollhub.train.grpo_loss.sampled_logprobs`). History-dependent penalties (repetition,
presence, frequency) are not part of it: runs refuse them (:meth:`Distribution.from_params`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rollhub.errors import InvalidInput

NEUTRAL_PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


@dataclass(frozen=True, slots=True)
class Distribution:
    """The settings that shape the sampling distribution of one sequence.

    Attributes:
        temperature: softmax temperature (> 0; greedy decoding has no distribution to train on).
        top_p: nucleus mass kept, in (0, 1]; 1 keeps everything.
        top_k: most likely tokens kept; 0 (or -1, vLLM's spelling) keeps everything.
        min_p: tokens below ``min_p`` times the top probability are dropped, in [0, 1]; 0 keeps everything.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise InvalidInput(
                f"temperature {self.temperature} has no sampling distribution to train on; sample with "
                "temperature > 0 (greedy completions are for evaluation)",
                field="temperature",
            )
        if not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p {self.top_p} must be in (0, 1]; 1 turns it off", field="top_p")
        if self.top_k < -1:
            raise InvalidInput(f"top_k {self.top_k} must be >= 0 (0 or -1 turns it off)", field="top_k")
        if not 0 <= self.min_p <= 1:
            raise InvalidInput(f"min_p {self.min_p} must be in [0, 1]; 0 turns it off", field="min_p")

    @property
    def truncates(self) -> bool:
        """Whether min-p, top-k or top-p can drop tokens (the support is then smaller than the vocabulary)."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0

    @classmethod
    def from_params(cls, params: Mapping[str, Any], where: str = "generation_params") -> Distribution:
        """The distribution of a sampling-settings mapping (a group's ``generation_params``, a request body).

        Unknown keys are ignored; missing ones take vLLM's neutral values.

        Raises:
            InvalidInput: a history-dependent penalty is set (the trainer does not reproduce it), or a value is
                out of range; the message names ``where`` and the key.
        """
        for key, neutral in NEUTRAL_PENALTIES.items():
            value = params.get(key)
            if value is not None and float(value) != neutral:
                raise InvalidInput(
                    f"{where}.{key} = {value}: the trainer does not reproduce history-dependent penalties, so the "
                    f"log-probs would not be of the distribution that sampled the tokens; set it to {neutral}",
                    field=key,
                )
        try:
            return cls(
                temperature=float(params.get("temperature", 1.0)),
                top_p=float(params.get("top_p", 1.0)),
                top_k=int(params.get("top_k") or 0),
                min_p=float(params.get("min_p", 0.0)),
            )
        except InvalidInput as exc:
            raise InvalidInput(f"{where}: {exc}", field=exc.field) from None

    def as_params(self) -> dict[str, float | int]:
        """The settings as ``generation_params`` fields (what a group records about how it was sampled)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}


def _column(values: torch.Tensor | float | int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a ``[rows, 1]`` column (a scalar is repeated)."""
    t = torch.as_tensor(values, dtype=dtype)
    return t.expand(rows).reshape(rows, 1) if t.dim() == 0 else t.reshape(rows, 1)


def processed_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int = 0,
    top_p: torch.Tensor | float = 1.0,
    min_p: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """Logits ``[rows, vocab]`` tempered and truncated (dropped tokens ``-inf``), per row (see the module docstring).

    Every setting is a scalar or a ``[rows]`` tensor, so rows sampled with different settings share one call.
    ``log_softmax`` of the result is the sampling distribution's log-probs; gradients flow to the kept logits.
    """
    rows, vocab = logits.shape
    out = logits.float() / _column(temperature, rows, torch.float32)
    min_p = _column(min_p, rows, torch.float32)
    if bool((min_p > 0).any()):
        probs = torch.softmax(out.detach(), dim=-1)
        out = out.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), -math.inf)
    top_k = _column(top_k, rows, torch.long)
    top_p = _column(top_p, rows, torch.float32)
    use_k, use_p = (top_k > 0) & (top_k < vocab), top_p < 1
    if not bool(use_k.any() or use_p.any()):
        return out
    ordered, order = out.detach().sort(dim=-1)  # ascending, as vLLM sorts
    drop = torch.zeros_like(ordered, dtype=torch.bool)
    if bool(use_k.any()):
        kth = ordered.gather(1, (vocab - top_k.clamp(1, vocab)).clamp(0, vocab - 1))
        drop |= use_k & (ordered < kth)
    if bool(use_p.any()):
        mass = torch.softmax(ordered.masked_fill(drop, -math.inf), dim=-1).cumsum(dim=-1)
        tail = use_p & (mass <= 1 - top_p)
        tail[:, -1] = False  # the most likely token always stays
        drop |= tail
    return out.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -math.inf)
