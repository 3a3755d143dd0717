"""What GRPO does with groups that carry less (or more) than rollhub's own: no behaviour log-probs, per-token
advantages sent by the environment, groups of another size than the run's (Atropos's ``ScoredData``)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from rollhub.envs.group.mock import MockEnv
from rollhub.experience import Group, Ragged
from rollhub.inference.torch_policy import LocalPolicy
from rollhub.train.grpo import GRPOConfig, GRPOTrainer, group_advantages, groups_to_batch, grpo_loss, sampled_logprobs
from rollhub.train.offpolicy import preset


def sampled(policy: LocalPolicy, n_groups: int = 4, size: int = 6, seed: int = 0) -> list[Group]:
    groups, _ = MockEnv(max_tokens=3).sample(policy, n_groups, size, "train", np.random.default_rng(seed))
    return groups


def with_rows(group: Group, **fields: Ragged | None) -> Group:
    """A copy of ``group`` with per-token fields replaced (``None``: left out)."""
    return dataclasses.replace(group, **fields)


def own_logprobs(model: torch.nn.Module, groups: list[Group]) -> list[Group]:
    """``groups`` with ``inference_logprobs`` set to ``model``'s log-probs of their tokens (1.0 on the prompt)."""
    batch = groups_to_batch(groups)
    with torch.no_grad():
        logp = sampled_logprobs(model, batch).logprobs
    out, row = [], 0
    for group in groups:
        rows = []
        for length in group.tokens.lengths:
            values = np.ones(int(length))
            completion = batch.loss_mask[row, 1:length].numpy() > 0
            values[1:][completion] = logp[row, : length - 1].numpy()[completion]
            rows.append(values)
            row += 1
        out.append(with_rows(group, inference_logprobs=Ragged.from_rows(rows, np.float64)))
    return out


def trained(model: torch.nn.Module, groups: list[Group], name: str) -> dict[str, torch.Tensor]:
    trainer = GRPOTrainer(copy.deepcopy(model), GRPOConfig(lr=1e-2, epochs=3, correction=preset(name)))
    trainer.step(groups)
    return trainer.weights()


@pytest.mark.parametrize("name", ["tis", "ppo", "decoupled", "icepop", "seq_mask"])
def test_without_behaviour_logprobs_the_update_assumes_the_data_is_on_policy(policy: LocalPolicy, name: str) -> None:
    """The trainer's own log-probs at the start of the update stand in for the missing ones, in every epoch:
    the update is the one on data whose stored log-probs are exactly the trainer's."""
    groups = sampled(policy)
    bare = [with_rows(g, inference_logprobs=None) for g in groups]
    on_policy = trained(policy.model, own_logprobs(policy.model, groups), name)
    recomputed = trained(policy.model, bare, name)
    assert all(torch.allclose(on_policy[k], recomputed[k], atol=1e-6) for k in on_policy)
    # stored log-probs that are not the trainer's (stale data) make another update: the comparison can fail
    shifted = [with_rows(g, inference_logprobs=Ragged(g.inference_logprobs.data - 2.0, g.inference_logprobs.offsets))
               for g in own_logprobs(policy.model, groups)]  # fmt: skip
    stale = trained(policy.model, shifted, name)
    assert not all(torch.allclose(on_policy[k], stale[k], atol=1e-6) for k in on_policy)


def test_recomputed_tokens_are_counted_and_left_out_of_the_mismatch(policy: LocalPolicy) -> None:
    groups = sampled(policy)
    mixed = [groups[0], with_rows(groups[1], inference_logprobs=Ragged.from_rows([], np.float64)), *groups[2:]]
    batch = groups_to_batch(mixed)
    _, stats = grpo_loss(policy.model, batch, clip_eps=0.2, current_version=0)
    tokens = batch.loss_mask[:, 1:].sum(1)
    second = slice(groups[0].size, groups[0].size + groups[1].size)
    assert stats["recomputed_fraction"] == pytest.approx(float(tokens[second].sum() / tokens.sum()))
    assert stats["mismatch_tokens"] == float(tokens.sum() - tokens[second].sum())
    assert stats["mismatch_abs"] < 1e-5  # the sampler's own log-probs, where they were sent


def test_per_token_advantages_from_the_environment_replace_grpos(policy: LocalPolicy) -> None:
    """A group whose scores are all equal teaches GRPO nothing; advantages it sends itself do, token by token:
    the first completion token's log-prob rises (advantage +1) and the second's falls (-1)."""
    (group,) = sampled(policy, n_groups=1, size=4)
    group = with_rows(group, advantages=None)
    group.scores = np.ones(group.size)
    rows = []
    for length, mask in zip(group.tokens.lengths, group.masks.rows(), strict=True):
        adv, first = np.zeros(int(length)), int(np.flatnonzero(mask != -100)[0])
        adv[first], adv[first + 1] = 1.0, -1.0
        rows.append(adv)
    sent = with_rows(group, advantages=Ragged.from_rows(rows, np.float64))

    def token_logprobs(model: torch.nn.Module) -> torch.Tensor:
        batch = groups_to_batch([sent])
        with torch.no_grad():
            return sampled_logprobs(model, batch).logprobs

    before = token_logprobs(policy.model)
    plain = GRPOTrainer(copy.deepcopy(policy.model), GRPOConfig(lr=1e-2))
    plain.step([group])
    assert all(torch.equal(plain.weights()[k], v) for k, v in policy.model.state_dict().items())  # no signal
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=1e-2))
    stats = trainer.step([sent])
    change = token_logprobs(policy.model) - before
    batch = groups_to_batch([sent])
    first = torch.tensor([int(np.flatnonzero(m[1:] > 0)[0]) for m in batch.loss_mask.numpy()])
    rows_ = torch.arange(len(first))
    assert (change[rows_, first] > 0).all() and (change[rows_, first + 1] < 0).all()
    assert stats["env_advantage_fraction"] == 1.0


def test_advantages_equal_to_grpos_give_grpos_loss(policy: LocalPolicy) -> None:
    (group,) = sampled(policy, n_groups=1, size=6)
    grpo = group_advantages(group.scores)
    rows = [np.full(int(n), a) for n, a in zip(group.tokens.lengths, grpo, strict=True)]
    sent = with_rows(group, advantages=Ragged.from_rows(rows, np.float64))
    loss_grpo, _ = grpo_loss(policy.model, groups_to_batch([group]), clip_eps=0.2)
    loss_sent, stats = grpo_loss(policy.model, groups_to_batch([sent]), clip_eps=0.2)
    assert (
        float(loss_sent.detach()) == pytest.approx(float(loss_grpo.detach()), abs=1e-6)
        and stats["env_advantage_fraction"] == 1.0
    )


def test_advantage_rows_that_do_not_match_the_tokens_are_refused(policy: LocalPolicy) -> None:
    """A server run with --no-check-advantage-lengths stores them; the trainer names the group and the field."""
    (group,) = sampled(policy, n_groups=1, size=2)
    short = with_rows(group, advantages=Ragged.from_rows([np.zeros(1), np.zeros(1)], np.float64))
    with pytest.raises(Exception, match="group 0 has advantages rows that do not match its token rows"):
        groups_to_batch([short])


def test_groups_of_another_size_are_trained_within_their_own_group_and_counted(policy: LocalPolicy) -> None:
    groups = sampled(policy, n_groups=1, size=4) + sampled(policy, n_groups=1, size=2, seed=1)
    groups += sampled(policy, n_groups=1, size=1, seed=2)
    batch = groups_to_batch(groups)
    adv = batch.advantages.numpy()
    assert adv[:4].sum() == pytest.approx(0.0, abs=1e-5) and adv[4:6].sum() == pytest.approx(0.0, abs=1e-5)
    assert adv[6] == 0.0  # one sequence: no spread, nothing to learn from it
    stats = GRPOTrainer(policy.model, GRPOConfig(group_size=4)).step(groups)
    assert stats["off_size_groups"] == 2.0
    assert GRPOTrainer(policy.model, GRPOConfig()).step(groups)["off_size_groups"] == 0.0  # not counted


def test_an_override_zeroes_a_sequences_advantage(policy: LocalPolicy) -> None:
    """Atropos's ``overrides[i]["set_advantage_to_zero"]``, as its example trainer reads it."""
    (group,) = sampled(policy, n_groups=1, size=4, seed=5)
    group.scores = np.array([1.0, 0.0, 1.0, 0.0])
    overrides = [{}, {"set_advantage_to_zero": True}, {"temperature": 1.0}, {}]
    zeroed = dataclasses.replace(group, meta={**group.meta, "overrides": overrides})
    rows = [np.ones(int(n)) for n in group.tokens.lengths]
    batch = groups_to_batch([zeroed, with_rows(zeroed, advantages=Ragged.from_rows(rows, np.float64))])
    assert batch.advantages[:4].tolist() == pytest.approx([1.0, 0.0, 1.0, -1.0], abs=1e-3)
    assert batch.token_advantages()[5].abs().sum() == 0.0 and batch.token_advantages()[4].abs().sum() > 0
