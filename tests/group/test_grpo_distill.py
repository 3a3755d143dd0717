"""The optional teacher-KL term of GRPO, fed by AtroposLib's ``distill_token_ids`` and ``distill_logprobs``."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from rollhub.envs.group.mock import MockEnv
from rollhub.errors import InvalidInput
from rollhub.experience import Group
from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer
from rollhub.train.grpo import GRPOConfig, GRPOTrainer, groups_to_batch, grpo_loss

TOP_K = 3


def teacher_model(policy: LocalPolicy) -> TinyTransformer:
    torch.manual_seed(123)
    teacher = TinyTransformer(policy.model.cfg)
    teacher.eval()
    return teacher


def with_teacher(groups: list[Group], teacher: torch.nn.Module, k: int = TOP_K) -> list[Group]:
    """The groups with the teacher's top-``k`` at every completion position (an empty list elsewhere)."""
    out = []
    for group in groups:
        ids_rows, lp_rows = [], []
        for tokens, mask in zip(group.tokens.rows(), group.masks.rows(), strict=True):
            with torch.no_grad():
                logp = torch.log_softmax(teacher(torch.as_tensor(tokens[None, :-1], dtype=torch.long)), -1)[0]
            top = logp.topk(k, dim=-1)
            ids = [[] if t == 0 or mask[t] == -100 else top.indices[t - 1].tolist() for t in range(len(tokens))]
            lps = [[] if t == 0 or mask[t] == -100 else top.values[t - 1].tolist() for t in range(len(tokens))]
            ids_rows.append(ids)
            lp_rows.append(lps)
        meta = {**group.meta, "distill_token_ids": ids_rows, "distill_logprobs": lp_rows}
        out.append(dataclasses.replace(group, meta=meta, scores=np.zeros(group.size)))  # no reward signal
    return out


def support_kl(model: torch.nn.Module, groups: list[Group]) -> float:
    """Mean over distilled positions of KL(teacher || student), both renormalised over the teacher's tokens."""
    batch = groups_to_batch(groups, distill=True)
    assert batch.teacher is not None
    with torch.no_grad():
        logp = torch.log_softmax(model(batch.tokens[:, :-1]), -1)
    ids, teacher = batch.teacher.ids[:, 1:], batch.teacher.logprobs[:, 1:]
    student = logp.gather(-1, ids)
    given = torch.isfinite(teacher) & (batch.loss_mask[:, 1:, None] > 0)
    q = torch.log_softmax(teacher.masked_fill(~given, -1e9), -1)
    p = torch.log_softmax(student.masked_fill(~given, -1e9), -1)
    per_position = torch.where(given, q.exp() * (q - p), 0.0).sum(-1)
    positions = given.any(-1)
    return float(per_position[positions].mean())


def test_the_teacher_term_moves_the_student_toward_the_teacher(policy: LocalPolicy) -> None:
    groups, _ = MockEnv(max_tokens=4).sample(policy, 6, 4, "train", np.random.default_rng(0))
    groups = with_teacher(groups, teacher_model(policy))
    untouched = copy.deepcopy(policy.model)
    before = support_kl(policy.model, groups)
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=1e-2, distill_coef=1.0, mismatch_warn=None))  # same data
    figures = [trainer.step(groups)["distill_kl"] for _ in range(30)]
    after = support_kl(policy.model, groups)
    assert after < 0.5 * before, (before, after)
    assert figures[-1] < 0.7 * figures[0], figures  # the loss's own figure (full-vocabulary student) falls too
    off = GRPOTrainer(untouched, GRPOConfig(lr=1e-2))  # distill_coef 0: the fields are not read
    stats = off.step(groups)
    assert "distill_kl" not in stats and support_kl(untouched, groups) == pytest.approx(before)


def test_the_term_is_the_same_in_chunks_and_whole(policy: LocalPolicy) -> None:
    groups, _ = MockEnv(max_tokens=4).sample(policy, 3, 4, "train", np.random.default_rng(1))
    groups = with_teacher(groups, teacher_model(policy))
    figures, grads = [], []
    for chunk in (None, 64):
        policy.model.zero_grad()
        loss, stats = grpo_loss(policy.model, groups_to_batch(groups, distill=True), 0.2, chunk_elements=chunk,
                                distill_coef=1.0)  # fmt: skip
        loss.backward()
        figures.append((stats["distill_kl"], stats["distill_positions"]))
        grads.append([p.grad.clone() for p in policy.model.parameters()])
    assert figures[0][0] == pytest.approx(figures[1][0], rel=1e-5) and figures[0][1] == figures[1][1] > 0
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))


def test_positions_without_entries_and_groups_without_the_fields_add_nothing(policy: LocalPolicy) -> None:
    groups, _ = MockEnv(max_tokens=4).sample(policy, 2, 4, "train", np.random.default_rng(2))
    taught = with_teacher(groups[:1], teacher_model(policy))
    batch = groups_to_batch([*taught, groups[1]], distill=True)
    _, stats = grpo_loss(policy.model, batch, 0.2, distill_coef=1.0)
    completion = batch.loss_mask[:, 1:].sum(1)
    assert stats["distill_positions"] == float(completion[: groups[0].size].sum())  # only the first group's
    assert groups_to_batch(groups, distill=True).teacher is None  # nobody sent a teacher


def test_teacher_rows_that_do_not_match_the_tokens_are_named(policy: LocalPolicy) -> None:
    groups, _ = MockEnv(max_tokens=4).sample(policy, 1, 2, "train", np.random.default_rng(3))
    (taught,) = with_teacher(groups, teacher_model(policy))
    short = {**taught.meta, "distill_logprobs": [row[:-1] for row in taught.meta["distill_logprobs"]]}
    with pytest.raises(InvalidInput, match="group 0 sequence 0: distill_token_ids and distill_logprobs need one"):
        groups_to_batch([dataclasses.replace(taught, meta=short)], distill=True)
    alone = {k: v for k, v in taught.meta.items() if k != "distill_logprobs"}
    with pytest.raises(InvalidInput, match="sends only one of distill_token_ids and distill_logprobs"):
        groups_to_batch([dataclasses.replace(taught, meta=alone)], distill=True)
    with pytest.raises(InvalidInput, match="distill_coef"):
        GRPOConfig(distill_coef=-1.0)


def test_trainer_distill_coef_reaches_the_trainer_and_is_checked() -> None:
    from rollhub.run.assemble import grpo_trainer
    from rollhub.run.config import RunConfigError, load_config
    from rollhub.run.group_parts import LocalBackend

    data = {"env": {"kind": "group", "id": "mock"}, "trainer": {"distill_coef": 0.5}}
    config = load_config(data)
    assert grpo_trainer(config, None, LocalBackend(config.policy).trainer_model()).config.distill_coef == 0.5
    assert load_config({"env": data["env"]}).trainer.distill_coef == 0.0  # off unless asked for
    with pytest.raises(RunConfigError, match=r"trainer\.distill_coef"):
        load_config({**data, "trainer": {"distill_coef": -1}})
