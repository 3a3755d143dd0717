"""Supervised fine-tuning on groups: the loss is the cross-entropy of the trained (unmasked) tokens only, and steps
lower it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rollhub.envs.group.scored import group_of_rows
from rollhub.errors import InvalidInput
from rollhub.experience import Group
from rollhub.experience.group import PROMPT_MASK
from rollhub.models import build_tiny_model, load_causal_lm, logits_of
from rollhub.train.grpo_loss import groups_to_batch
from rollhub.train.sft import SupervisedConfig, SupervisedTrainer, supervised_loss


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sft") / "model")


def rows() -> tuple[list[list[int]], list[list[int]]]:
    tokens = [[1, 20, 21, 22, 23, 24, 25], [1, 30, 31, 32, 33]]
    masks = [[PROMPT_MASK, PROMPT_MASK, 21, 22, PROMPT_MASK, 24, 25], [PROMPT_MASK, PROMPT_MASK, 31, 32, 33]]
    return tokens, masks


def group(masks: list[list[int]] | None = None) -> Group:
    tokens, trained = rows()
    masks = trained if masks is None else masks
    arrays = [np.asarray(t, np.int32) for t in tokens]
    return group_of_rows(arrays, [np.asarray(m, np.int32) for m in masks], [np.ones(len(t)) for t in tokens],
                         [0.0, 1.0], {})  # fmt: skip


def test_the_loss_is_the_cross_entropy_of_the_trained_tokens_only(tiny_dir: Path) -> None:
    model = load_causal_lm(str(tiny_dir))
    loss, stats = supervised_loss(model, groups_to_batch([group()]))
    tokens, masks = rows()
    total, n = 0.0, 0
    with torch.no_grad():
        for toks, mask in zip(tokens, masks, strict=True):
            logp = torch.log_softmax(logits_of(model(torch.tensor([toks])))[0].float(), -1)
            for t in range(1, len(toks)):
                if mask[t] != PROMPT_MASK:
                    total -= float(logp[t - 1, toks[t]])
                    n += 1
    assert stats["tokens"] == n == 7
    assert float(loss.detach()) == pytest.approx(total / n, rel=1e-5)


def test_steps_lower_the_loss_and_a_batch_with_nothing_to_train_is_refused(tiny_dir: Path) -> None:
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_dir))
    trainer = SupervisedTrainer(model, SupervisedConfig(lr=3e-3))
    first = trainer.step([group()])["nll"]
    for _ in range(20):
        last = trainer.step([group()])["nll"]
    assert last < first / 2 and trainer.steps == 21
    tokens, _ = rows()
    masked = group([[PROMPT_MASK] * len(t) for t in tokens])
    with pytest.raises(InvalidInput, match="no trained token"):
        trainer.step([masked])
    with pytest.raises(InvalidInput, match="lr"):
        SupervisedConfig(lr=0)
    assert np.isfinite(last)
