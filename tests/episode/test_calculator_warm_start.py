"""The calculator's warm start by demonstration: its three behaviours (the right call, the slip, the guess) in the
shares asked, guesses never the question's product, answers copying the tool's result, no held-out problem, and only
the scripted turns trained."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest

from rollhub.envs.episode import ChatRenderer, EpisodeLimits, parse_tool_calls
from rollhub.envs.episode.calculator import CalculatorEnv, demonstration_script, judge, warm_start_groups
from rollhub.errors import ConfigError
from rollhub.experience.group import PROMPT_MASK

LIMITS = EpisodeLimits(max_tokens=400, turn_max_tokens=120, max_turns=3)  # room for a call in this tokenizer


def test_the_held_out_problems_are_never_demonstrated(tiny_tokenizer: Any) -> None:
    env = CalculatorEnv(lo=2, hi=9)
    train, held_out = set(env.train_problems), set(env.eval_problems)
    assert train and held_out and not (train & held_out) and len(train | held_out) == 8 * 8
    with pytest.raises(ConfigError, match=r"held-out ones \[\(2, 2\)\]"):
        warm_start_groups(
            env, ChatRenderer(tiny_tokenizer), [env.train_problems[0], (2, 2)], 1, LIMITS, np.random.default_rng(0)
        )


def test_the_script_slips_guesses_or_calls_right_in_the_shares_asked_and_copies_the_result() -> None:
    script = demonstration_script(2, 9, right_share=0.5, guess_share=0.2)
    rng = np.random.default_rng(3)
    kinds = {"right": 0, "slip": 0, "guess": 0}
    guesses = set()
    n = 4000
    for i in range(n):
        a, b = 2 + i % 8, 3 + (i // 8) % 7  # b is never 2, a == b sometimes
        turn = script(f"system: tools calc(a, b)\nuser: {a}*{b}=?\nassistant: ", rng)
        calls = parse_tool_calls(turn)
        if not calls:
            assert turn.isdigit() and int(turn) != a * b  # a guess, never the answer
            guesses.add(int(turn))
            kinds["guess"] += 1
            continue
        (call,) = calls
        assert call.name == "calc"
        x, y = call.arguments["a"], call.arguments["b"]
        assert (x, y) in {(a, b), (a, a)}
        kinds["slip" if (x, y) == (a, a) and a != b else "right"] += 1
    assert len(guesses) > 20  # guesses spread over the products, not one fixed number
    # binomial: 4000 draws put each share within 0.03 of its value with room to spare (about 4 sigma); a slip on a
    # question with a == b is the right call (1 question in 8 here)
    slips_right = 0.3 / 8
    assert abs(kinds["right"] / n - (0.5 + slips_right)) < 0.03 and abs(kinds["guess"] / n - 0.2) < 0.03
    assert script("user: 3*4=?\nassistant: <tool_call>{}</tool_call>\ntool: <tool_response>35</tool_response>\n"
                  "assistant: ", rng) == "35"  # fmt: skip
    with pytest.raises(ValueError, match="no question"):
        script("user: hello\nassistant: ", rng)
    for right, guess in [(-0.1, 0.2), (0.7, 0.4), (0.5, 1.1)]:
        with pytest.raises(ConfigError, match="right_share"):
            demonstration_script(2, 9, right, guess)


def test_warm_start_groups_train_the_scripted_turns_only(tiny_tokenizer: Any) -> None:
    env = CalculatorEnv(lo=2, hi=9)
    renderer = ChatRenderer(tiny_tokenizer)
    groups = warm_start_groups(env, renderer, env.train_problems, 60, LIMITS, np.random.default_rng(2))
    assert len(groups) == 60
    eos = tiny_tokenizer.eos_token_id
    seen = {"right": 0, "slip": 0, "guess": 0}
    for g in groups:
        (tokens,), (mask,) = list(g.tokens.rows()), list(g.masks.rows())
        tokens, mask = np.asarray(tokens), np.asarray(mask)
        text = tiny_tokenizer.decode(tokens, skip_special_tokens=False)
        a, b = map(int, re.search(r"user: (\d+)\*(\d+)=\?", text).groups())
        assert (a, b) in env.train_problems
        trained = mask != PROMPT_MASK
        assert np.array_equal(mask[trained], tokens[trained])
        spans = np.split(tokens[trained], np.flatnonzero(np.diff(np.flatnonzero(trained)) > 1) + 1)
        assert all(span[-1] == eos for span in spans)
        untrained = tiny_tokenizer.decode(tokens[~trained], skip_special_tokens=False)
        assert f"user: {a}*{b}=?" in untrained and "assistant: " in untrained and "<tool_call>" not in untrained
        assert json.dumps(g.meta["generation_params"])
        if len(spans) == 1:  # a guess: one turn, no call, never the product, no reward
            (guess,) = spans
            assert int(tiny_tokenizer.decode(guess, skip_special_tokens=True)) != a * b
            assert g.scores[0] == 0.0
            seen["guess"] += 1
            continue
        call_ids, answer_ids = spans  # a call turn and the answer turn
        (call,) = parse_tool_calls(tiny_tokenizer.decode(call_ids, skip_special_tokens=True))
        product = call.arguments["a"] * call.arguments["b"]
        assert tiny_tokenizer.decode(answer_ids, skip_special_tokens=True) == str(product)
        # what is not trained: the prompt (question and tool list), the tool's reply, the template's words
        assert f"<tool_response>{product}</tool_response>" in untrained
        slip = (call.arguments["a"], call.arguments["b"]) == (a, a) and a != b
        assert slip or (call.arguments["a"], call.arguments["b"]) == (a, b)
        assert g.scores[0] == (0.0 if slip else 1.0)  # only a call with the question's operands solves it
        seen["slip" if slip else "right"] += 1
    assert all(seen.values())  # all three behaviours are demonstrated
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
