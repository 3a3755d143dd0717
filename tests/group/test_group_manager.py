from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from group_helpers import ScriptedPolicy

from rollhub.envs.group.base import Mode
from rollhub.envs.group.scored import AbortedCompletionError, group_info, make_group
from rollhub.errors import ConfigError
from rollhub.experience import Group
from rollhub.inference.base import InferenceContext, SamplingParams
from rollhub.inference.torch_policy import LocalPolicy
from rollhub.rollout.group.manager import GroupRolloutManager, ManagerError
from rollhub.rollout.protocols import RolloutManager, SampleRequest
from rollhub.wire.group import check_group, group_to_item


def test_manager_samples_a_batch_standalone(policy: LocalPolicy, make_config) -> None:
    """The plan's standalone test: no worker, no weight transport, no curriculum, no storage."""
    manager = GroupRolloutManager(make_config(), policy)
    assert isinstance(manager, RolloutManager)  # the one contract the worker drives
    result = manager.sample_batch(SampleRequest(5, "worker-a", lesson_id="easy"))
    groups = result.items
    assert len(groups) == 3 and all(isinstance(g, Group) and g.size == 4 for g in groups)  # the lesson's sizes
    for g in groups:
        assert g.policy_version == 5 and group_info(g)["worker_id"] == "worker-a"
        assert group_info(g)["env_name"] == "easy" and group_info(g)["timestamp"] > 0
        assert g.inference_logprobs is not None and (g.masks.data == -100).any()
        check_group(g)
        assert group_to_item(g)["policy_version"] == 5
    assert result.stats is not None and result.stats.n_sequences == 12 and result.stats.lesson_id == "easy"
    assert result.env_steps == 12 and set(result.metrics) >= {"mean_reward", "accuracy"}
    manager.shutdown()


def test_max_examples_caps_a_turn_and_never_enlarges_it(policy: LocalPolicy, make_config) -> None:
    """Admission control's cap: fewer prompts than the lesson's (or the request's) when smaller, never more."""
    manager = GroupRolloutManager(make_config(), policy)
    assert len(manager.sample_batch(SampleRequest(0, "w", lesson_id="easy", max_examples=2)).items) == 2
    assert len(manager.sample_batch(SampleRequest(0, "w", lesson_id="easy", max_examples=9)).items) == 3
    capped = SampleRequest(0, "w", lesson_id="easy", n_examples=5, max_examples=4)
    assert len(manager.sample_batch(capped).items) == 4
    manager.shutdown()


def test_same_seed_gives_the_same_groups(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(), policy)
    a = manager.sample_batch(SampleRequest(0, "w", lesson_id="easy", n_examples=2, seed=11)).items
    b = manager.sample_batch(SampleRequest(0, "w", lesson_id="easy", n_examples=2, seed=11)).items
    assert [r.tolist() for r in a[0].tokens.rows()] == [r.tolist() for r in b[0].tokens.rows()]


def test_eval_mode_samples_one_greedy_completion_per_prompt(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(), policy)
    result = manager.sample_batch(SampleRequest(1, "w", lesson_id="hard", mode="eval", n_examples=5))
    assert len(result.items) == 5 and all(g.size == 1 for g in result.items)
    assert result.stats is not None and result.stats.n_sequences == 5


def test_min_version_is_honoured(policy: LocalPolicy, make_config) -> None:
    """Weights older than the worker's floor produce nothing (and say so), never stale groups."""
    manager = GroupRolloutManager(make_config(), policy)
    result = manager.sample_batch(SampleRequest(3, "w", min_version=4, lesson_id="easy"))
    assert result.items == [] and result.dropped_groups == 3 and "older than min_version 4" in result.events[0]
    fresh = manager.sample_batch(SampleRequest(4, "w", min_version=4, lesson_id="easy"))
    assert len(fresh.items) == 3 and fresh.dropped_groups == 0


def test_empty_environment_gives_no_groups(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(empty=True), policy)
    result = manager.sample_batch(SampleRequest(0, "w", lesson_id="easy"))
    assert result.items == [] and result.stats is not None and result.stats.n_sequences == 0


def test_a_request_needs_a_known_lesson(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(), policy)
    with pytest.raises(ConfigError, match="lesson_id"):
        manager.sample_batch(SampleRequest(0, "w"))
    with pytest.raises(ConfigError, match="unknown lesson 'nope'"):
        manager.sample_batch(SampleRequest(0, "w", lesson_id="nope"))


def test_update_model_swaps_weights_in_place(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(), policy)
    zeroed = {k: torch.zeros_like(v) for k, v in policy.model.state_dict().items()}
    manager.update_model(zeroed)
    assert all(float(p.detach().abs().sum()) == 0.0 for p in policy.model.parameters())
    after = manager.sample_batch(SampleRequest(1, "w", lesson_id="easy", mode="eval", n_examples=4)).items
    # All-zero weights give uniform log-probs: every completion token has log-prob -log(vocab).
    lp = np.concatenate([g.inference_logprobs.data[g.masks.data != -100] for g in after if g.inference_logprobs])
    assert lp.size and np.allclose(lp, -np.log(policy.tokenizer.vocab_size), atol=1e-5)


def test_shutdown_makes_later_calls_fail(policy: LocalPolicy, make_config) -> None:
    manager = GroupRolloutManager(make_config(), policy)
    manager.shutdown()
    with pytest.raises(ManagerError, match="shut down"):
        manager.sample_batch(SampleRequest(0, "w", lesson_id="easy"))


def test_update_model_needs_a_swappable_policy(make_config) -> None:
    class Remote:
        def complete(self, prompts, n, params, rng):
            return []

    manager = GroupRolloutManager(make_config(), Remote())
    with pytest.raises(ManagerError, match="cannot load weights"):
        manager.update_model({})


def test_aborted_completions_are_counted_and_never_stored(make_config) -> None:
    """Three prompts of four: the second has two aborted completions, the third one; only the first is kept."""
    manager = GroupRolloutManager(make_config(), ScriptedPolicy(aborted={(1, 0), (1, 3), (2, 2)}))
    result = manager.sample_batch(SampleRequest(0, "w", lesson_id="easy"))
    assert len(result.items) == 1 and result.items[0].size == 4 and result.env_steps == 4
    assert result.metrics["aborted_completions"] == 3.0 and result.metrics["aborted_groups"] == 2.0
    clean = manager.sample_batch(SampleRequest(0, "w", lesson_id="easy", n_examples=1))
    assert clean.metrics["aborted_completions"] == 0.0  # counted per call, not carried over
    assert clean.metrics["aborted_groups"] == 0.0


class CarelessEnv:
    """A user's environment that scores whatever it gets, without leaving aborted completions out."""

    name = "careless"

    def __init__(self) -> None:
        self.seen: Any = None

    def sample(
        self, inference_ctx: InferenceContext, n_examples: int, n_generations: int, mode: Mode, rng: np.random.Generator
    ) -> tuple[list[Group], dict[str, float]]:
        self.seen = inference_ctx.tokenizer  # the policy's own attributes stay reachable
        completions = inference_ctx.complete(["1+1="] * n_examples, n_generations, SamplingParams(3), rng)
        groups = [make_group(self.name, "1+1", c, [0.0] * len(c), [False] * len(c)) for c in completions]
        return groups, {}


def test_an_environment_that_keeps_an_aborted_completion_fails_instead_of_storing_it(make_config) -> None:
    env = CarelessEnv()
    manager = GroupRolloutManager(make_config(), ScriptedPolicy(aborted={(0, 1)}), env_loader=lambda spec, args: env)
    with pytest.raises(AbortedCompletionError, match="drop_aborted"):
        manager.sample_batch(SampleRequest(0, "w", lesson_id="easy"))
    assert env.seen == "scripted"
    healthy = GroupRolloutManager(make_config(), ScriptedPolicy(), env_loader=lambda spec, args: env)
    assert len(healthy.sample_batch(SampleRequest(0, "w", lesson_id="easy")).items) == 3


def test_a_sampling_override_passes_weights_and_close_to_the_policy_under_it(make_config) -> None:
    from rollhub.inference.override import with_sampling

    class Swappable:
        def __init__(self) -> None:
            self.loaded: list[Any] = []
            self.closed = False

        def complete(self, prompts, n, params, rng):
            return []

        def load_weights(self, weights):
            self.loaded.append(weights)

        def close(self) -> None:
            self.closed = True

    inner = Swappable()
    manager = GroupRolloutManager(make_config(), with_sampling(inner, {"temperature": 0.7}))
    manager.update_model({"w": np.zeros(2)})
    assert len(inner.loaded) == 1
    manager.shutdown()
    assert inner.closed

    class Remote:  # neither capability, under an override too: refused by name, and shutdown has nothing to close
        def complete(self, prompts, n, params, rng):
            return []

    manager = GroupRolloutManager(make_config(), with_sampling(Remote(), {"temperature": 0.7}))
    with pytest.raises(ManagerError, match="Remote cannot load weights"):
        manager.update_model({})
    manager.shutdown()
