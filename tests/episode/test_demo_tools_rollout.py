"""``rollhub demo tools`` without vLLM: its two ways of playing training episodes, on a scripted engine. Through the
gateway, a plain ``openai``-client agent plays each episode and the gateway hands the groups over; in process,
rollhub's episode loop does. Both report the share of right calls from what the model wrote."""

from __future__ import annotations

import argparse
import types
from typing import Any

import numpy as np
import pytest
from episode_fakes import FakeEngine, ScriptedPolicy, assert_exact_rows, solver

from rollhub.demos.tools import right_calls, rollout
from rollhub.envs.episode import ChatRenderer, EpisodeGroupEnv, EpisodeLimits
from rollhub.envs.episode.calculator import CalculatorEnv
from rollhub.envs.episode.prioritized import PrioritizedTasks
from rollhub.inference.openai_client import OpenAICompletionsClient

LIMITS = EpisodeLimits(max_tokens=400, turn_max_tokens=120, max_turns=3)  # room for a call in this tokenizer


def wrong_operands(text: str) -> str:
    """Calls calc with the question's first operand and 9, then answers with what it returned."""
    if "<tool_response>" not in text:
        a = text.split("user: ")[-1].split("*")[0]
        return f'<tool_call>{{"name": "calc", "arguments": {{"a": {a}, "b": 9}}}}</tool_call>'
    return text.split("<tool_response>")[-1].split("</tool_response>")[0]


def play(tokenizer: Any, script: Any, via_gateway: bool) -> tuple[list[Any], dict[str, float], FakeEngine]:
    task = CalculatorEnv(lo=2, hi=4, operand_reward=0.1)
    env = EpisodeGroupEnv(PrioritizedTasks(task), ChatRenderer(tokenizer), LIMITS)  # as the demo draws its tasks
    args = argparse.Namespace(via_gateway=via_gateway, groups=2, group_size=3)
    trainer = types.SimpleNamespace(policy_version=4)
    with FakeEngine(ScriptedPolicy(tokenizer, script)) as engine:
        client = OpenAICompletionsClient(engine.url, "tiny", send_seed=False, max_retries=0)
        with rollout(args, env, client, task, LIMITS, trainer) as sample:
            groups, metrics = sample(np.random.default_rng(0))
        client.close()
    return groups, metrics, engine


@pytest.mark.parametrize("via_gateway", [True, False], ids=["gateway", "in-process"])
def test_a_solving_model_is_scored_one_in_both_modes(tiny_tokenizer: Any, via_gateway: bool) -> None:
    if via_gateway:
        pytest.importorskip("openai")
    groups, metrics, engine = play(tiny_tokenizer, solver, via_gateway)
    assert len(groups) == 2 and all(g.size == 3 for g in groups)
    assert metrics["accuracy"] == 1.0 and metrics["right_call_rate"] == 1.0 and metrics["mean_turns"] == 2
    # both modes count each played problem's outcome for the prioritized draws (two draws: one or two problems):
    # every one solved, no group informative
    assert 1 <= metrics["tasks_seen"] == metrics["tasks_solved"] <= 2 and metrics["informative_groups"] == 0.0
    for g in groups:
        assert list(g.scores) == [1.0, 1.0, 1.0]
        assert assert_exact_rows(g, engine.policy.handed_out) == 6  # two sampled turns per episode, exact ids
    if via_gateway:
        assert all(g.policy_version == 4 for g in groups)  # the version the trainer posted to the gateway
    else:
        assert right_calls(groups) == 1.0


@pytest.mark.parametrize("via_gateway", [True, False], ids=["gateway", "in-process"])
def test_a_call_with_other_operands_earns_only_the_shaping(tiny_tokenizer: Any, via_gateway: bool) -> None:
    if via_gateway:
        pytest.importorskip("openai")
    groups, metrics, _ = play(tiny_tokenizer, wrong_operands, via_gateway)
    assert metrics["accuracy"] == 0.0 and metrics["right_call_rate"] == 0.0
    assert metrics["tasks_seen"] >= 1 and metrics["tasks_solved"] == 0
    for g in groups:  # one question operand carried (9 is outside 2..4): 0.1
        assert np.allclose(g.scores, 0.1)
    if not via_gateway:
        assert right_calls(groups) == 0.0
