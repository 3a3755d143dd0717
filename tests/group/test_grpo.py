from __future__ import annotations

import numpy as np
import pytest
import torch

from rollhub.client.types import Batch
from rollhub.envs.group.mock import MockEnv
from rollhub.errors import InvalidInput
from rollhub.experience import Group
from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer
from rollhub.train.grpo import (
    GRPOConfig,
    GRPOState,
    GRPOTrainer,
    group_advantages,
    groups_to_batch,
    grpo_loss,
    train_grpo,
)
from rollhub.wire.group import group_from_json


def _groups(policy: LocalPolicy, n_groups: int = 4, version: int | None = 0, seed: int = 0) -> list[Group]:
    groups, _ = MockEnv(max_tokens=3).sample(policy, n_groups, 6, "train", np.random.default_rng(seed))
    for g in groups:
        g.policy_version = version
    return groups


def test_group_advantages() -> None:
    adv = group_advantages(np.array([1.0, 0.0, 0.0, 1.0]))
    assert adv.sum() == pytest.approx(0.0) and adv[0] == pytest.approx(1.0, abs=1e-3)
    assert np.array_equal(group_advantages(np.array([0.7, 0.7, 0.7])), np.zeros(3))


def test_batch_aligns_masks_and_behaviour_logprobs() -> None:
    item = {
        "tokens": [[1, 5, 6, 7], [1, 5, 8]],
        "masks": [[-100, -100, 6, 7], [-100, -100, 8]],
        "inference_logprobs": [[1.0, 1.0, -0.5, -0.25], [1.0, 1.0, -2.0]],
        "scores": [1.0, 0.0],
        "policy_version": 3,
    }
    b = groups_to_batch([group_from_json(item)])
    assert b.tokens.tolist() == [[1, 5, 6, 7], [1, 5, 8, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert b.behaviour_logprobs.tolist() == [
        [0, 0, -0.5, -0.25],
        [0, 0, -2.0, 0],
    ]  # the 1.0 fillers never leak
    assert b.advantages[0] > 0 > b.advantages[1] and b.policy_versions.tolist() == [3, 3]
    assert b.recorded.tolist() == [1.0, 1.0]
    without = groups_to_batch([group_from_json({**item, "inference_logprobs": None})])
    assert without.recorded.tolist() == [0.0, 0.0]  # the trainer's proximal log-probs stand in (grpo_loss)
    with pytest.raises(InvalidInput, match="inference_logprobs"):
        groups_to_batch([group_from_json({**item, "inference_logprobs": [[1.0, 1.0, -0.5], [1.0, 1.0, -2.0]]})])


def test_batch_of_groups_of_different_sizes_and_versions() -> None:
    one = {"tokens": [[1, 2, 3]], "masks": [[-100, 2, 3]], "inference_logprobs": [[1.0, -1.0, -2.0]], "scores": [1]}
    two = {
        "tokens": [[4, 5], [4, 6, 7, 8]],
        "masks": [[-100, 5], [-100, 6, 7, 8]],
        "inference_logprobs": [[1.0, -0.5], [1.0, -0.5, -0.5, -0.5]],
        "scores": [0.0, 1.0],
        "policy_version": 2,
    }
    b = groups_to_batch([group_from_json(one), group_from_json(two)])
    assert b.tokens.tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [4, 6, 7, 8]]
    assert b.loss_mask.sum(1).tolist() == [2, 1, 3]
    assert b.policy_versions.tolist() == [-1, 2, 2]
    assert b.advantages.tolist()[0] == 0.0  # a one-sequence group has no spread


def test_on_policy_ratio_is_one(policy: LocalPolicy) -> None:
    """The sampler's stored log-probs equal the trainer's recomputation, token for token."""
    batch = groups_to_batch(_groups(policy))
    _, stats = grpo_loss(policy.model, batch, clip_eps=0.2)
    assert stats["approx_kl"] < 1e-6 and stats["clip_fraction"] == 0.0


def test_a_step_raises_the_logprob_of_better_completions(policy: LocalPolicy) -> None:
    groups = _groups(policy)
    batch = groups_to_batch(groups)
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=1e-2))

    def seq_logp() -> torch.Tensor:
        with torch.no_grad():
            logp = torch.log_softmax(policy.model(batch.tokens[:, :-1]), -1)
            tok = logp.gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
            return (tok * batch.loss_mask[:, 1:]).sum(1)

    before = seq_logp()
    trainer.step(groups)
    change = seq_logp() - before
    pos, neg = batch.advantages > 0, batch.advantages < 0
    assert change[pos].mean() > 0 > change[neg].mean()


def test_clipping_stops_the_gradient_beyond_the_trust_region(policy: LocalPolicy) -> None:
    batch = groups_to_batch(_groups(policy))
    batch.behaviour_logprobs -= batch.loss_mask * 1.0  # ratio e > 1 + eps everywhere
    batch.advantages = batch.advantages.abs() + 1.0  # all positive: the clipped branch is taken
    loss, stats = grpo_loss(policy.model, batch, clip_eps=0.2)
    loss.backward()
    assert stats["clip_fraction"] == 1.0
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in policy.model.parameters())


def test_a_step_trains_on_every_group_measures_the_lag_and_publishes(policy: LocalPolicy) -> None:
    """The trainer applies no staleness bound (the buffer did before serving): old groups are trained on and
    their lag reported."""
    published: list[int] = []
    trainer = GRPOTrainer(policy.model, GRPOConfig(), publish=lambda s, sd: published.append(s))
    trainer.step_count = 5
    groups = _groups(policy, version=4) + _groups(policy, version=1, seed=1) + _groups(policy, version=None, seed=2)
    stats = trainer.step(groups)
    assert published == [6] and trainer.policy_version == 6 and "dropped_stale" not in stats
    assert stats["staleness"] == 4.0 and stats["mean_staleness"] == 2.5  # lags 1 and 4; unversioned not counted
    assert stats["completion_tokens"] == float(groups_to_batch(groups).loss_mask.sum())  # all 12 groups trained
    assert stats["version_lag_max"] == 4.0


def test_grpo_learns_the_mock_task(policy: LocalPolicy) -> None:
    """A few steps on the mock environment raise its mean reward well above the untrained policy's."""
    env = MockEnv(max_tokens=3)
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=3e-3))
    rng = np.random.default_rng(0)

    def reward() -> float:
        _, m = env.sample(policy, 64, 4, "train", np.random.default_rng(123))
        return m["mean_reward"]

    start = reward()
    for _ in range(120):
        groups, _ = env.sample(policy, 8, 8, "train", rng)
        trainer.step(groups)
    end = reward()
    assert end > start + 0.3, (start, end)


class ListSource:
    """A :class:`GroupSource` over a guarded buffer, handing out prepared batches (``None``: nothing within
    ``wait_s``); it leaves nothing out."""

    stale_groups = 0
    batches_skipped = 0

    def __init__(self, batches: list[list[Group] | None]) -> None:
        self.batches = batches
        self.acked = 0
        self.versions: list[int] = []

    def next_batch(self, wait_s: float) -> Batch | None:
        groups = self.batches.pop(0) if self.batches else None
        return None if groups is None else Batch(groups)

    def ack(self) -> None:
        self.acked += 1

    def publish_version(self, version: int) -> None:
        self.versions.append(version)


def test_train_grpo_trains_every_served_batch_whole_and_tells_the_source_each_version(policy: LocalPolicy) -> None:
    """Version 0 is published first; an empty poll changes nothing; each served batch (a guarded buffer's) is
    trained on whole, however far behind, acknowledged, and its version announced; the lag is measured."""
    published: list[int] = []
    trainer = GRPOTrainer(policy.model, GRPOConfig(), lambda v, _w: published.append(v))
    versions = [0, 0, 0, 2]  # at trainer versions 0, 1, 2 (version 0 is 2 behind), 3 (version 2 is 1 behind)
    source = ListSource([None, *(_groups(policy, version=v) for v in versions)])
    state = GRPOState()
    seen: list[dict[str, float]] = []

    def after_update(s: GRPOState, stats: dict[str, float]) -> str | None:
        seen.append(stats)
        return "done" if trainer.policy_version == 4 else None

    reason = train_grpo(trainer, source, state, stop_reason=lambda: None, after_update=after_update, wait_s=0.0)
    assert reason == "done" and published == [0, 1, 2, 3, 4] and source.versions == [0, 1, 2, 3, 4]
    assert (state.batches, state.skipped, state.stale_groups, source.acked) == (4, 0, 0, 4)
    assert [s["staleness"] for s in seen] == [0.0, 1.0, 2.0, 1.0] and [s["stale_groups"] for s in seen] == [0.0] * 4
    assert state.max_staleness_seen == 2 and state.trained_sequences == 4 * 4 * 6
    assert state.staleness == [0] * 4 + [1] * 4 + [2] * 4 + [1] * 4


class DroppingSource(ListSource):
    """A source over an unguarded buffer that left ``drops[i]`` groups out before serving batch ``i`` (and skipped
    one batch whole before the third)."""

    def __init__(self, batches: list[list[Group] | None], drops: list[int]) -> None:
        super().__init__(batches)
        self.drops = drops
        self.stale_groups = 0
        self.batches_skipped = 0

    def next_batch(self, wait_s: float) -> Batch | None:
        served = super().next_batch(wait_s)
        if served is not None:
            self.stale_groups += self.drops.pop(0)
            self.batches_skipped += len(self.versions) == 2
        return served


def test_train_grpo_counts_what_the_source_left_out(policy: LocalPolicy) -> None:
    trainer = GRPOTrainer(policy.model, GRPOConfig())
    source = DroppingSource([_groups(policy, version=0), _groups(policy, version=1)], drops=[0, 5])
    state = GRPOState()
    seen: list[float] = []

    def after_update(s: GRPOState, stats: dict[str, float]) -> str | None:
        seen.append(stats["stale_groups"])
        return "done" if trainer.policy_version == 2 else None

    train_grpo(trainer, source, state, stop_reason=lambda: None, after_update=after_update, wait_s=0.0)
    assert seen == [0.0, 5.0] and (state.batches, state.skipped, state.stale_groups) == (3, 1, 5)


def test_trainer_state_dict_round_trips(policy: LocalPolicy) -> None:
    """Weights, Adam moments, the version and the torch RNG come back; training continues identically."""
    trainer = GRPOTrainer(policy.model, GRPOConfig(lr=3e-3))
    trainer.step(_groups(policy))
    arrays, values = trainer.state_dict()
    torch.manual_seed(1)
    other = GRPOTrainer(TinyTransformer(policy.model.cfg), GRPOConfig(lr=3e-3))
    other.load_state_dict(arrays, values)
    assert other.policy_version == 1
    batch = _groups(policy, seed=3)
    trainer.step(batch)
    other.step(batch)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, other.model.state_dict()[name]), name
