"""The long-completion repeat task: its split, its reward over the whole completion, its sampling settings."""

from __future__ import annotations

import numpy as np
import pytest

from rollhub.envs.group import GroupEnv, load_environment_from_spec
from rollhub.envs.group.repeat import RepeatEnv
from rollhub.envs.group.scored import group_info
from rollhub.errors import ConfigError
from rollhub.inference.base import Completion, SamplingParams


def _completion(text: str, reason: str = "length") -> Completion:
    return Completion((1,), tuple(range(len(text))), (-0.5,) * len(text), text, reason)


class Answering:
    """An inference context answering every prompt with its last digit repeated ``right`` times and ``"+"``
    after that, ``length`` characters in all; records the settings it was asked for."""

    def __init__(self, right: int, length: int, aborted: int | None = None) -> None:
        self.right, self.length, self.aborted = right, length, aborted
        self.params: list[SamplingParams] = []
        self.prompts: list[str] = []

    def complete(self, prompts: list[str], n: int, params: SamplingParams,
                 rng: np.random.Generator) -> list[list[Completion]]:  # fmt: skip
        self.params.append(params)
        self.prompts += prompts
        text = lambda p: p[-2] * self.right + "+" * (self.length - self.right)  # noqa: E731
        return [[_completion(text(p), "abort" if i == self.aborted else "length") for _ in range(n)]
                for i, p in enumerate(prompts)]  # fmt: skip


def test_the_builtin_id_loads_it() -> None:
    env = load_environment_from_spec("repeat", {"length": 8, "prompt_digits": 2, "n_eval": 10})
    assert isinstance(env, RepeatEnv) and isinstance(env, GroupEnv) and env.name == "repeat"


def test_the_reward_is_the_share_of_the_whole_completion_that_is_right() -> None:
    env = RepeatEnv(length=8, prompt_digits=2, n_eval=10, pass_share=0.75)
    answer = env.answer("73=")
    assert answer == "33333333"
    assert env.score(_completion("33333333"), answer) == (1.0, True)
    assert env.score(_completion("33333377"), answer) == (0.75, True)
    assert env.score(_completion("3333337"), answer) == (0.75, True)  # a missing character counts as wrong
    assert env.score(_completion("7333333"), answer) == (0.75, True)
    assert env.score(_completion("33333+"), answer) == (0.625, False)
    assert env.score(_completion("3333333333"), answer) == (1.0, True)  # past the length is not scored
    assert RepeatEnv(length=8, prompt_digits=2, n_eval=10).score(_completion("33333377"), answer)[1] is False


def test_held_out_prompts_are_never_trained_on_and_the_split_is_fixed_by_its_seed() -> None:
    env = RepeatEnv(prompt_digits=3, n_eval=40)
    assert len(env.eval_prompts) == 40 and len(env.train_prompts) == 960
    assert not set(env.eval_prompts) & set(env.train_prompts)
    assert RepeatEnv(prompt_digits=3, n_eval=40).eval_prompts == env.eval_prompts
    assert RepeatEnv(prompt_digits=3, n_eval=40, split_seed=1).eval_prompts != env.eval_prompts
    ctx = Answering(right=5, length=10)
    env.sample(ctx, 30, 2, "train", np.random.default_rng(0))
    assert set(ctx.prompts) <= set(env.train_prompts)
    ctx = Answering(right=5, length=10)
    groups, _ = env.sample(ctx, 100, 1, "eval", np.random.default_rng(0))
    assert sorted(ctx.prompts) == sorted(env.eval_prompts)  # eval: every held-out prompt once, at most
    assert len(groups) == 40


def test_samples_run_to_their_full_length_and_eval_is_greedy() -> None:
    env = RepeatEnv(length=12, prompt_digits=2, n_eval=10, pass_share=0.5, temperature=0.8)
    ctx = Answering(right=9, length=12)
    groups, metrics = env.sample(ctx, 3, 4, "train", np.random.default_rng(1))
    (train,) = ctx.params
    assert (train.max_tokens, train.temperature, train.stop_eos) == (12, 0.8, False)
    assert len(groups) == 3 and all(g.size == 4 for g in groups)
    assert np.allclose([s for g in groups for s in g.scores], 0.75)
    assert metrics["accuracy"] == 1.0 and metrics["mean_reward"] == pytest.approx(0.75)
    assert all(group_info(g)["correct"] == [True] * 4 for g in groups)
    env.sample(ctx, 2, 1, "eval", np.random.default_rng(1))
    assert ctx.params[-1].greedy and ctx.params[-1].stop_eos is False


def test_a_prompt_with_an_aborted_completion_is_left_out() -> None:
    env = RepeatEnv(length=6, prompt_digits=2, n_eval=10)
    groups, _ = env.sample(Answering(right=6, length=6, aborted=1), 3, 2, "train", np.random.default_rng(2))
    assert len(groups) == 2


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"length": 0}, "length"),
        ({"prompt_digits": 0}, "prompt_digits"),
        ({"prompt_digits": 7}, "prompt_digits"),
        ({"pass_share": 0.0}, "pass_share"),
        ({"prompt_digits": 1, "n_eval": 6}, "n_eval"),
        ({"n_eval": 0}, "n_eval"),
    ],
)
def test_bad_settings_name_their_field(args: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RepeatEnv(**args)
