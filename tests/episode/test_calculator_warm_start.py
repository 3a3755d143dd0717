"""The calculator's format warm start: its problems are neither training nor held-out ones, its calls never carry
the question's product, its answers copy the tool's result, and only the scripted turns are trained."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest

from rollhub.envs.episode import ChatRenderer, EpisodeLimits, parse_tool_calls
from rollhub.envs.episode.calculator import CalculatorEnv, format_script, judge, warm_start_groups
from rollhub.errors import ConfigError
from rollhub.experience.group import PROMPT_MASK

LIMITS = EpisodeLimits(max_tokens=400, turn_max_tokens=120, max_turns=3)  # room for a call in this tokenizer


def test_the_three_splits_share_no_problem_and_cover_the_range() -> None:
    env = CalculatorEnv(lo=2, hi=9)
    before = list(env.train_problems)
    warm = env.split_warm_start(3)
    train, held_out = set(env.train_problems), set(env.eval_problems)
    assert warm and train and held_out
    assert not (set(warm) & train) and not (set(warm) & held_out) and not (train & held_out)
    assert set(warm) | train == set(before)
    assert len(set(warm) | train | held_out) == 8 * 8
    drawn = {t.id for t in env.tasks(500, "train", np.random.default_rng(0))}
    assert drawn <= {f"{a}*{b}" for a, b in env.train_problems}  # the training draws no warm-start problem
    with pytest.raises(ConfigError, match="every"):
        env.split_warm_start(1)


def test_the_script_never_calls_with_the_questions_product_and_copies_the_result() -> None:
    script = format_script(2, 9)
    rng = np.random.default_rng(1)
    seen = set()
    for a in range(2, 10):
        for b in range(2, 10):
            for _ in range(20):
                (call,) = parse_tool_calls(script(f"system: tools calc(a, b)\nuser: {a}*{b}=?\nassistant: ", rng))
                x, y = call.arguments["a"], call.arguments["b"]
                assert call.name == "calc" and 2 <= x <= 9 and 2 <= y <= 9 and x * y != a * b
                seen.add((x, y))
    assert len(seen) > 50  # operands spread over the range, not one fixed pair
    assert script("user: 3*4=?\nassistant: <tool_call>{}</tool_call>\ntool: <tool_response>35</tool_response>\n"
                  "assistant: ", rng) == "35"  # fmt: skip
    with pytest.raises(ValueError, match="no question"):
        script("user: hello\nassistant: ", rng)


def test_warm_start_groups_train_the_scripted_turns_only(tiny_tokenizer: Any) -> None:
    env = CalculatorEnv(lo=2, hi=9)
    warm = env.split_warm_start(3)
    renderer = ChatRenderer(tiny_tokenizer)
    groups = warm_start_groups(env, renderer, warm, 40, LIMITS, np.random.default_rng(2))
    assert len(groups) == 40
    eos = tiny_tokenizer.eos_token_id
    for g in groups:
        (tokens,), (mask,) = list(g.tokens.rows()), list(g.masks.rows())
        tokens, mask = np.asarray(tokens), np.asarray(mask)
        text = tiny_tokenizer.decode(tokens, skip_special_tokens=False)
        a, b = map(int, re.search(r"user: (\d+)\*(\d+)=\?", text).groups())
        assert (a, b) in warm
        trained = mask != PROMPT_MASK
        assert np.array_equal(mask[trained], tokens[trained])
        spans = np.split(tokens[trained], np.flatnonzero(np.diff(np.flatnonzero(trained)) > 1) + 1)
        call_ids, answer_ids = spans  # exactly two trained spans: the call turn and the answer turn
        assert call_ids[-1] == eos and answer_ids[-1] == eos
        (call,) = parse_tool_calls(tiny_tokenizer.decode(call_ids, skip_special_tokens=True))
        product = call.arguments["a"] * call.arguments["b"]
        assert product != a * b
        assert tiny_tokenizer.decode(answer_ids, skip_special_tokens=True) == str(product)
        # what is not trained: the prompt (question and tool list), the tool's reply, the template's words
        untrained = tiny_tokenizer.decode(tokens[~trained], skip_special_tokens=False)
        assert f"user: {a}*{b}=?" in untrained and f"<tool_response>{product}</tool_response>" in untrained
        assert "assistant: " in untrained and "<tool_call>" not in untrained
        assert g.scores[0] == 0.0  # no warm-start episode solves its task
        assert json.dumps(g.meta["generation_params"])
    with pytest.raises(ConfigError, match="no warm-start problems"):
        warm_start_groups(env, renderer, [], 1, LIMITS, np.random.default_rng(0))


def test_judge_is_the_environments_rule() -> None:
    assert judge((3, 4), [(3, 4)], "12", True).correct
    assert judge((3, 4), [(4, 3)], " 12\n", True).reward == 1.0
    assert judge((3, 4), [(2, 6)], "12", True).reward == 1.0  # the right product, whatever the operands
    assert judge((3, 4), [(3, 4)], "12", False).reward == 0.5  # cut, not answered
    assert judge((3, 4), [], "12", True).reward == 0.0  # no tool: nothing
    assert judge((3, 4), [(2, 5), (3, 4)], "13", True).reward == 0.25
    assert judge((3, 4), [None], "12", True).reward == 0.0
    # the shaping: per question operand carried (as a multiset), averaged over calls; a solve still earns 1
    assert judge((3, 4), [(3, 5)], "15", True, 0.1).reward == pytest.approx(0.1)
    assert judge((3, 3), [(3, 5)], "15", True, 0.1).reward == pytest.approx(0.1)
    assert judge((3, 3), [(3, 3)], "9", True, 0.1).reward == 1.0
    assert judge((3, 4), [(4, 3)], "11", True, 0.1).reward == pytest.approx(0.7)
    assert judge((3, 4), [(5, 6), None], "30", True, 0.1).reward == 0.0
    with pytest.raises(ConfigError, match="operand_reward"):
        CalculatorEnv(operand_reward=0.25)
