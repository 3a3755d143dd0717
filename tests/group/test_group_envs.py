from __future__ import annotations

import numpy as np
import pytest
from group_helpers import ScriptedPolicy

from rollhub.envs.group import GroupEnv, load_environment_from_spec
from rollhub.envs.group.arithmetic import ArithmeticEnv
from rollhub.envs.group.mock import MockEnv, MockEnvError
from rollhub.envs.group.scored import group_info
from rollhub.errors import ConfigError
from rollhub.experience import Group
from rollhub.inference.base import Completion
from rollhub.inference.torch_policy import LocalPolicy


def _completion(text: str, stop: bool = True) -> Completion:
    return Completion(
        (1,), tuple(range(len(text) + stop)), (0.0,) * (len(text) + stop), text, "stop" if stop else "length"
    )


def test_specs_load_builtins_and_dotted_paths() -> None:
    env = load_environment_from_spec("arithmetic", {"name": "a", "carry": "none"})
    assert isinstance(env, ArithmeticEnv) and isinstance(env, GroupEnv) and env.name == "a"
    assert isinstance(load_environment_from_spec("rollhub.envs.group.mock:MockEnv"), MockEnv)


@pytest.mark.parametrize(
    ("spec", "args", "message"),
    [
        ("no_colon_here", None, "must look like"),
        ("rollhub.no_such_module:X", None, "cannot import"),
        ("rollhub.envs.group.mock:Nope", None, "has no 'Nope'"),
        ("mock", {"bogus": 1}, "rejected arguments"),
        ("collections:OrderedDict", None, "lacks 'name'"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, args: dict | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_environment_from_spec(spec, args)


def test_arithmetic_reward_is_verifiable_with_partial_credit() -> None:
    env = ArithmeticEnv()
    assert env.answer(3, 4) == "07" and env.answer(9, 9) == "18"
    assert env.score(_completion("07"), "07") == (1.0, True)
    assert env.score(_completion("07", stop=False), "07") == (0.5, False)  # right digits, never stopped
    assert env.score(_completion("08"), "07") == (0.25, False)
    assert env.score(_completion("7"), "07") == (0.0, False)
    assert env.score(_completion("070"), "07") == (0.5, False)


def test_arithmetic_problem_sets_and_split() -> None:
    none, only = (
        ArithmeticEnv(carry="none", holdout_fraction=0.0),
        ArithmeticEnv(carry="only", holdout_fraction=0.0),
    )
    assert len(none.train_problems) == 55 and len(only.train_problems) == 45
    assert all(a + b < 10 for a, b in none.train_problems) and all(a + b >= 10 for a, b in only.train_problems)
    assert none.eval_problems == none.train_problems
    split = ArithmeticEnv(holdout_fraction=0.2, split_seed=3)
    assert len(split.eval_problems) == 20 and not set(split.eval_problems) & set(split.train_problems)
    assert ArithmeticEnv(holdout_fraction=0.2, split_seed=3).eval_problems == split.eval_problems
    with pytest.raises(ConfigError, match="holdout_fraction"):
        ArithmeticEnv(holdout_fraction=1.0)
    with pytest.raises(ConfigError, match="width 1 cannot hold sums up to 18"):
        ArithmeticEnv(width=1)


SPLITS = [
    {"max_operand": 49, "holdout_fraction": 0.2, "pad_operands": True},  # the demo's
    {"max_operand": 9, "holdout_fraction": 0.2, "carry": "only"},
    {"max_operand": 12, "holdout_fraction": 0.25, "carry": "none", "split_seed": 7},
    {"max_operand": 3, "holdout_fraction": 0.3},
]


@pytest.mark.parametrize("settings", SPLITS)
def test_held_out_problems_have_no_twin_or_prompt_in_training(settings: dict) -> None:
    env = ArithmeticEnv(**settings)
    train = set(env.train_problems)
    leaks = [(a, b) for a, b in env.eval_problems if (a, b) in train or (b, a) in train]
    assert leaks == []
    assert {env.prompt(a, b) for a, b in env.eval_problems}.isdisjoint(env.prompt(a, b) for a, b in train)
    everything = ArithmeticEnv(**{**settings, "holdout_fraction": 0.0}).train_problems
    assert sorted(env.train_problems + env.eval_problems) == everything  # every problem on exactly one side
    assert abs(len(env.eval_problems) - settings["holdout_fraction"] * len(everything)) <= 2  # one twin pair


def test_demo_split_holds_out_a_fifth_of_the_pairs() -> None:
    env = ArithmeticEnv(max_operand=49, holdout_fraction=0.2, pad_operands=True)
    assert len(env.eval_problems) == 500 and len(env.train_problems) == 2000


def test_split_is_fixed_by_its_seed() -> None:
    split = ArithmeticEnv(max_operand=49, holdout_fraction=0.2, split_seed=1)
    assert ArithmeticEnv(max_operand=49, holdout_fraction=0.2, split_seed=1).eval_problems == split.eval_problems
    other = ArithmeticEnv(max_operand=49, holdout_fraction=0.2, split_seed=2)
    assert other.eval_problems != split.eval_problems and len(other.eval_problems) == len(split.eval_problems)


def test_split_that_would_be_empty_is_refused() -> None:
    with pytest.raises(ConfigError, match="leaves a split empty"):
        ArithmeticEnv(max_operand=1, holdout_fraction=0.1)  # 0.1 of 4 problems rounds to none


def test_arithmetic_modes_draw_from_their_split(policy: LocalPolicy) -> None:
    env = ArithmeticEnv(holdout_fraction=0.2)
    groups, metrics = env.sample(policy, 50, 1, "eval", np.random.default_rng(0))
    ids = [group_info(g)["example_id"] for g in groups]
    assert len(ids) == 20 and len(set(ids)) == 20  # all held-out problems, without replacement
    assert {tuple(map(int, i.split("+"))) for i in ids} == set(env.eval_problems)
    groups, _ = env.sample(policy, 30, 2, "train", np.random.default_rng(0))
    assert {tuple(map(int, group_info(g)["example_id"].split("+"))) for g in groups} <= set(env.train_problems)
    assert set(metrics) == {"mean_reward", "accuracy", "informative_groups"}


def test_mock_env_can_fail_on_purpose(policy: LocalPolicy) -> None:
    env = MockEnv(fail_first=1)
    with pytest.raises(MockEnvError, match="on purpose"):
        env.sample(policy, 1, 1, "train", np.random.default_rng(0))
    groups, _ = env.sample(policy, 2, 3, "train", np.random.default_rng(0))
    assert [g.size for g in groups] == [3, 3]


def test_padded_operands_align_place_values(policy: LocalPolicy) -> None:
    env = ArithmeticEnv(max_operand=99, width=3, pad_operands=True, holdout_fraction=0.05)
    assert env.prompt(7, 35) == "07+35=" and env.answer(7, 35) == "042"
    assert len(env.train_problems) + len(env.eval_problems) == 10_000 and len(env.eval_problems) == 500
    groups, _ = env.sample(policy, 3, 2, "train", np.random.default_rng(0))
    prompt_lengths = [int((row == -100).sum()) for g in groups for row in g.masks.rows()]
    assert prompt_lengths == [7] * 6  # <bos> + "aa+bb="
    assert ArithmeticEnv().prompt(7, 3) == "7+3="


class CountingArithmetic(ArithmeticEnv):
    """Arithmetic that records every completion it scores and refuses to score an aborted one."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.scored: list[Completion] = []

    def score(self, completion: Completion, answer: str) -> tuple[float, bool]:
        assert completion.finish_reason != "abort", "an aborted completion was scored"
        self.scored.append(completion)
        return super().score(completion, answer)


def _example_ids(groups: list[Group]) -> list[str]:
    return [group_info(g)["example_id"] for g in groups]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_arithmetic_never_scores_a_prompt_with_an_aborted_completion(mode: str) -> None:
    env = CountingArithmetic(holdout_fraction=0.2)
    n = 4 if mode == "train" else 1
    everything, _ = env.sample(ScriptedPolicy(), 3, n, mode, np.random.default_rng(5))
    groups, _ = env.sample(ScriptedPolicy(aborted={(1, 0)}), 3, n, mode, np.random.default_rng(5))
    ids = _example_ids(everything)
    assert _example_ids(groups) == [ids[0], ids[2]]  # the same prompts drawn; the second one left out whole
    assert all(g.size == n for g in groups)
    assert len(env.scored) == 3 * n + 2 * n


def test_mock_env_leaves_out_prompts_with_an_aborted_completion() -> None:
    env = MockEnv()
    everything, _ = env.sample(ScriptedPolicy(), 3, 4, "train", np.random.default_rng(2))
    groups, _ = env.sample(ScriptedPolicy(aborted={(0, 3), (2, 1), (2, 2)}), 3, 4, "train", np.random.default_rng(2))
    assert _example_ids(groups) == [_example_ids(everything)[1]] and groups[0].size == 4
