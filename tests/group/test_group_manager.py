from __future__ import annotations

import numpy as np
import pytest
import torch

from rollhub.curriculum import Curriculum
from rollhub.inference.torch_policy import LocalPolicy
from rollhub.rollout.group_manager import GroupRolloutManager, ManagerError


def test_manager_samples_a_batch_standalone(policy: LocalPolicy, make_config) -> None:
    """The plan's standalone test: no worker, no weight transport, no storage."""
    manager = GroupRolloutManager(make_config(), policy)
    batch, metrics = manager.sample_batch("easy", 3, 4, "train", 0, weight_step=5, worker_id="worker-a")
    assert batch is not None and metrics is not None
    assert len(batch.groups) == 3 and all(len(g.rollouts) == 4 for g in batch.groups)
    assert batch.metadata.weight_step == 5 and batch.metadata.worker_id == "worker-a"
    for r in batch.rollouts:
        assert r.metadata == batch.metadata and r.env_name == "easy"
        assert len(r.response_logprobs) == len(r.response_tokens) > 0
    assert all(item["policy_version"] == 5 for item in batch.to_items())
    assert set(metrics) >= {"mean_reward", "accuracy"}


def test_same_rng_seed_gives_the_same_batch(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(), policy)
    a, _ = manager.sample_batch("easy", 2, 3, "train", 11, 0, "w")
    b, _ = manager.sample_batch("easy", 2, 3, "train", 11, 0, "w")
    assert a is not None and b is not None and a.to_items()[0]["tokens"] == b.to_items()[0]["tokens"]


def test_empty_environment_gives_no_batch_and_leaves_curriculum_alone(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(empty=True), policy)
    assert manager.sample_batch("easy", 2, 2, "train", 0, 0, "w") == (None, None)
    stats, batch = manager.evaluate_lesson("easy", 4, "eval", 0, step=1, weight_step=0, worker_id="w")
    assert stats.n_rollouts == 0 and batch.groups == ()
    assert isinstance(manager.curriculum, Curriculum)
    assert manager.curriculum.stats["easy"].eval_success is None


def test_only_full_eval_updates_the_curriculum(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(), policy)
    curriculum = manager.curriculum
    assert isinstance(curriculum, Curriculum)
    stats, batch = manager.evaluate_lesson("easy", 5, "micro_eval", 0, step=3, weight_step=1, worker_id="w")
    assert stats.n_rollouts == 5 and all(len(g.rollouts) == 1 for g in batch.groups)
    assert curriculum.stats["easy"].eval_step == -1
    manager.evaluate_lesson("easy", 5, "eval", 0, step=3, weight_step=1, worker_id="w")
    assert curriculum.stats["easy"].eval_step == 3
    results = manager.evaluate_curriculum(4, 1, step=9, weight_step=2, worker_id="w")
    assert set(results) == {"easy", "hard"}
    assert curriculum.stats["hard"].eval_step == 9 and curriculum.stats["hard"].eval_success is not None


def test_training_stats_feed_smoothed_success(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(), policy)
    batch, _ = manager.sample_batch("easy", 3, 4, "train", 0, 0, "w")
    assert batch is not None
    manager.update_training_stats("easy", batch, step=1)
    curriculum = manager.curriculum
    assert isinstance(curriculum, Curriculum)
    expected = sum(r.episode_reward for r in batch.rollouts) / 12
    assert curriculum.stats["easy"].smoothed_success == pytest.approx(expected)
    assert curriculum.stats["easy"].n_samples == 12


def test_update_model_swaps_weights_in_place(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(), policy)
    before, _ = manager.sample_batch("easy", 4, 1, "eval", 0, 0, "w")
    zeroed = {k: torch.zeros_like(v) for k, v in policy.model.state_dict().items()}
    manager.update_model(zeroed)
    assert all(float(p.detach().abs().sum()) == 0.0 for p in policy.model.parameters())
    after, _ = manager.sample_batch("easy", 4, 1, "eval", 0, 1, "w")
    assert before is not None and after is not None
    # All-zero weights give uniform log-probs: every token has log-prob -log(vocab).
    lp = np.array([x for r in after.rollouts for x in r.response_logprobs])
    assert np.allclose(lp, -np.log(policy.tokenizer.vocab_size), atol=1e-5)


def test_shutdown_makes_later_calls_fail(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(), policy)
    manager.shutdown()
    with pytest.raises(ManagerError, match="shut down"):
        manager.sample_batch("easy", 1, 1, "train", 0, 0, "w")


def test_update_model_needs_a_swappable_policy(make_config) -> None:
    class Remote:
        def complete(self, prompts, n, params, rng):
            return []

    manager = GroupRolloutManager(make_config(), Remote())
    with pytest.raises(ManagerError, match="cannot load weights"):
        manager.update_model({})
