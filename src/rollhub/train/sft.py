"""Supervised fine-tuning on groups: cross-entropy on the sampled positions only.

A *format warm start* teaches a model the shape of its turns (a tool call, then an answer) before reinforcement
learning, as real agent training starts from a model that already writes tool calls. The data are ordinary
:class:`~rollhub.experience.Group` objects, laid out as every group is: ``masks`` hold the token id where the
policy wrote the token and ``-100`` everywhere else (the prompt, tool results, template tokens), so the loss is
taken on the model's own turns only. Scores, advantages and behaviour log-probs are not read.

The loss is the mean negative log-likelihood of the trained tokens at temperature 1 (the model's own
distribution), computed with the GRPO trainer's forward pass (:func:`~rollhub.train.grpo_loss.sampled_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rollhub.errors import InvalidInput
from rollhub.experience import Group
from rollhub.models.sampling import Distribution
from rollhub.train.grpo_loss import DEFAULT_CHUNK_ELEMENTS, TokenBatch, groups_to_batch, sampled_logprobs


@dataclass(frozen=True, slots=True)
class SupervisedConfig:
    """Hyper-parameters of :class:`SupervisedTrainer`.

    Attributes:
        lr: Adam learning rate.
        max_grad_norm: gradients are clipped to this global norm.
        chunk_elements: logits per block in the forward pass (``None``: all at once).
    """

    lr: float = 3e-3
    max_grad_norm: float = 1.0
    chunk_elements: int | None = DEFAULT_CHUNK_ELEMENTS

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise InvalidInput(f"lr {self.lr} must be > 0", field="lr")
        if not self.max_grad_norm > 0:
            raise InvalidInput(f"max_grad_norm {self.max_grad_norm} must be > 0", field="max_grad_norm")


def supervised_loss(model: nn.Module, batch: TokenBatch, chunk_elements: int | None = DEFAULT_CHUNK_ELEMENTS
                    ) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """The mean negative log-likelihood of the batch's trained tokens, and ``nll`` and ``tokens`` as figures.

    Raises:
        InvalidInput: the batch has no trained token (every mask is ``-100``).
    """
    mask = batch.loss_mask[:, 1:]
    n = float(mask.sum())
    if n == 0:
        raise InvalidInput("the batch has no trained token: every position of its masks is -100", field="masks")
    logprobs = sampled_logprobs(model, batch, chunk_elements).logprobs
    loss = -(logprobs * mask).sum() / n
    return loss, {"nll": float(loss.detach()), "tokens": n}


class SupervisedTrainer:
    """Owns the model's Adam optimizer; ``step`` takes one supervised step on a list of groups.

    Every group is trained at temperature 1 with no truncation, whatever its ``generation_params`` say: the target
    is the data, not the distribution that sampled it.
    """

    def __init__(self, model: nn.Module, config: SupervisedConfig | None = None) -> None:
        self.model = model
        self.config = config or SupervisedConfig()
        self.optimizer = torch.optim.Adam(model.parameters(), lr=self.config.lr)
        self.steps = 0

    def step(self, groups: Sequence[Group]) -> dict[str, float]:
        """One optimizer step on ``groups``; returns ``nll`` (before the step), ``tokens`` and ``grad_norm``.

        Raises:
            InvalidInput: the groups cannot form a batch, or hold no trained token.
        """
        batch = groups_to_batch(list(groups), default=Distribution())
        batch.temperature.fill_(1.0)  # the model's own distribution, whatever sampled the data
        batch.top_p.fill_(1.0)
        batch.top_k.zero_()
        batch.min_p.zero_()
        self.model.eval()  # no dropout: the weights trained are the weights published
        loss, stats = supervised_loss(self.model, batch, self.config.chunk_elements)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        return stats | {"grad_norm": float(grad_norm)}
