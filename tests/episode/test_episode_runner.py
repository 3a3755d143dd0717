"""Episodes end to end in process: a tool task, malformed and cut turns, the whole-episode budget, the discount, a
history-rewriting template that forks rows, and what GRPO's batch trains of them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from episode_fakes import REWRITING_TEMPLATE, FollowUpEnv, ScriptedPolicy, assert_exact_rows, solver

from rollhub.envs.episode import (
    ChatRenderer,
    Episode,
    EpisodeGroupEnv,
    EpisodeLimits,
    Outcome,
    Task,
    TokenDriftError,
    run_episodes,
)
from rollhub.envs.episode.calculator import CalculatorEnv
from rollhub.envs.episode.tokens import EpisodeTokens
from rollhub.experience.episodes import episode_count, episode_index
from rollhub.inference.base import Completion, SamplingParams
from rollhub.train.grpo_loss import groups_to_batch
from rollhub.wire.group import check_group

LIMITS = EpisodeLimits(max_tokens=250, turn_max_tokens=100)
RNG = np.random.default_rng(0)


def calc_call(text: str, arguments: str | None = None) -> str:
    a, b = text.split("user: ")[1].split("=?")[0].split("*")
    args = arguments or f'{{"a": {a}, "b": {b}}}'
    return f'<tool_call>{{"name": "calc", "arguments": {args}}}</tool_call>'


def sample(tokenizer: Any, script: Any, limits: EpisodeLimits = LIMITS, n: int = 3) -> tuple[Any, ScriptedPolicy]:
    policy = ScriptedPolicy(tokenizer, script)
    env = EpisodeGroupEnv(CalculatorEnv(), ChatRenderer(tokenizer), limits, SamplingParams(temperature=0.7))
    groups, metrics = env.sample(policy, 2, n, "train", RNG)
    return (groups, metrics), policy


def test_a_tool_episode_holds_the_engines_ids_and_the_rendered_rest(tiny_tokenizer: Any) -> None:
    (groups, metrics), policy = sample(tiny_tokenizer, solver)
    assert len(groups) == 2 and metrics["accuracy"] == 1.0 and metrics["mean_turns"] == 2.0
    for g in groups:
        check_group(g)
        assert g.size == 3 and episode_count(g) == 3 and list(g.scores) == [1.0, 1.0, 1.0]
        assert assert_exact_rows(g, policy.handed_out) == 6  # two model turns per row
        record = g.meta["overrides"][0]["rollhub"]
        assert record["turns"] == 2 and record["finish"] == "done" and not record["truncated"]
        assert g.meta["generation_params"]["temperature"] == 0.7
        # one row per append-only episode: the whole conversation, tool result included, in one sequence
        messages = g.meta["messages"][0]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        renderer = ChatRenderer(tiny_tokenizer)
        tools = CalculatorEnv().tool_schemas()
        text = renderer.text(messages, tools, False)
        assert list(g.tokens.row(0)) == renderer.encode(text, special=True)[:-1]  # all but the closing "\n"


def test_a_malformed_call_is_a_scored_turn_and_the_episode_goes_on(tiny_tokenizer: Any) -> None:
    def clumsy(text: str) -> str:
        calls = text.count("<tool_response>")
        if calls == 0:
            return calc_call(text, '{"a": 2')  # not JSON
        if calls == 1:
            return '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>'  # no such tool
        return solver(text)

    (groups, metrics), policy = sample(tiny_tokenizer, clumsy, EpisodeLimits(max_tokens=400, turn_max_tokens=100))
    g = groups[0]
    assert metrics["tool_errors"] == 2.0 and metrics["truncated_fraction"] == 0.0
    tool_replies = [m["content"] for m in g.meta["messages"][0] if m["role"] == "tool"]
    assert tool_replies[0].startswith("error: the call is not JSON") and "no tool named 'abacus'" in tool_replies[1]
    # the last answer repeats the last tool reply (an error text), so it scores nothing; the two bad calls cost 0.1 each
    assert g.scores[0] == pytest.approx(-0.2)
    assert_exact_rows(g, policy.handed_out)


def test_a_turn_cut_at_its_cap_is_scored_and_flags_its_episode(tiny_tokenizer: Any) -> None:
    (groups, metrics), _ = sample(tiny_tokenizer, solver, EpisodeLimits(max_tokens=250, turn_max_tokens=20))
    g = groups[0]
    assert metrics["truncated_fraction"] == 1.0
    assert g.meta["group_overrides"]["rollhub"]["truncated_episodes"] == 3
    record = g.meta["overrides"][0]["rollhub"]
    assert record == {"episode": record["episode"], "row": 0, "turns": 1, "truncated": True, "finish": "length"}
    assert g.scores[0] == pytest.approx(-0.1)  # the cut call is unclosed: malformed, and scored as such


def test_the_budget_is_the_whole_episodes(tiny_tokenizer: Any) -> None:
    def verbose(text: str) -> str:
        return solver(text) if "<tool_response>" not in text else "the product is " + solver(text) + " for sure"

    limits = EpisodeLimits(max_tokens=170, turn_max_tokens=100)
    (groups, metrics), policy = sample(tiny_tokenizer, verbose, limits)
    assert metrics["truncated_fraction"] == 1.0
    for g in groups:
        assert all(n <= limits.max_tokens for n in g.tokens.lengths)
        assert g.meta["overrides"][0]["rollhub"]["finish"] == "budget"
    second = [s for s in policy.handed_out if "<tool_response>" in tiny_tokenizer.decode(s.prompt)]
    # the second turn was given what was left of the episode's budget, not its own turn cap, and used it all
    assert second and all(s.max_tokens == limits.max_tokens - len(s.prompt) < 100 for s in second)
    assert all(len(s.prompt) + len(s.ids) == limits.max_tokens for s in second)


def test_rewards_of_later_turns_are_discounted() -> None:
    task = Task("t", [{"role": "user", "content": "q"}])
    for turns, expected in [(1, 1.0), (2, 0.9), (3, 0.81)]:
        ep = Episode(task, "t/0", EpisodeTokens([1]), [], turn_rewards=[0.0] * turns, outcome=Outcome(1.0))
        assert ep.score(0.9) == pytest.approx(expected)
    ep = Episode(task, "t/0", EpisodeTokens([1]), [], turn_rewards=[-0.1, 0.5], outcome=Outcome(1.0))
    assert ep.score(0.5) == pytest.approx(-0.1 + 0.5 * 1.5)


def test_turn_limits_and_aborts(tiny_tokenizer: Any) -> None:
    looping = lambda text: calc_call(text)  # noqa: E731 - never answers
    (groups, metrics), _ = sample(tiny_tokenizer, looping, EpisodeLimits(max_tokens=1000, turn_max_tokens=100,
                                                                         max_turns=3))  # fmt: skip
    assert metrics["mean_turns"] == 3.0 and groups[0].meta["overrides"][0]["rollhub"]["finish"] == "max_turns"

    def flaky(text: str) -> str | None:
        return None if "<tool_response>" in text and "4*" in text else solver(text)

    policy = ScriptedPolicy(tiny_tokenizer, flaky)
    env = EpisodeGroupEnv(CalculatorEnv(lo=3, hi=4), ChatRenderer(tiny_tokenizer), LIMITS)
    groups, metrics = env.sample(policy, 6, 2, "train", np.random.default_rng(1))
    assert metrics["aborted_tasks"] > 0 and len(groups) == 6 - metrics["aborted_tasks"]
    assert all(not g.meta["group_overrides"]["rollhub"]["example_id"].startswith("4*") for g in groups)


def test_an_engine_that_changes_the_prompt_is_refused(tiny_tokenizer: Any) -> None:
    class Prepending(ScriptedPolicy):
        def complete(self, prompts: list[Any], n: int, params: SamplingParams, rng: Any) -> list[list[Completion]]:
            out = super().complete(prompts, n, params, rng)
            return [[Completion((1, *c.prompt_tokens), c.tokens, c.logprobs, c.text, c.finish_reason)
                     for c in comps] for comps in out]  # fmt: skip

    env = CalculatorEnv()
    with pytest.raises(TokenDriftError, match="first differ at position"):
        run_episodes(env, Prepending(tiny_tokenizer, solver), ChatRenderer(tiny_tokenizer), [env.task(2, 3)], 1,
                     LIMITS, SamplingParams(), RNG)  # fmt: skip


def test_a_template_that_rewrites_history_forks_the_episode_into_rows(tiny_tokenizer: Any) -> None:
    def thinker(text: str) -> str:  # the third episode's second answer (the sixth turn handed out) is wrong
        return "<think>add</think>" + ("47" if len(policy.handed_out) == 5 else "46")

    policy = ScriptedPolicy(tiny_tokenizer, thinker)
    renderer = ChatRenderer(tiny_tokenizer, chat_template=REWRITING_TEMPLATE)
    groups, metrics = EpisodeGroupEnv(FollowUpEnv(), renderer, LIMITS).sample(policy, 1, 3, "train", RNG)
    g = groups[0]
    assert metrics["forked_fraction"] == 1.0 and g.size == 6 and episode_count(g) == 3
    assert list(episode_index(g)) == [0, 0, 1, 1, 2, 2]
    assert [o["rollhub"]["row"] for o in g.meta["overrides"]] == [0, 1] * 3
    assert assert_exact_rows(g, policy.handed_out) == 6  # one sampled turn per row
    second = tiny_tokenizer.decode(list(g.tokens.row(1)))
    assert second.count("think") == 2  # the earlier turn's reasoning is gone from the new row's context
    # GRPO compares episodes: every row of an episode gets its episode's advantage, a forked episode counts once
    batch = groups_to_batch(groups)
    assert list(g.scores) == [2.0, 2.0, 2.0, 2.0, 1.0, 1.0]
    adv = batch.advantages.numpy()
    assert adv[0] == adv[1] == adv[2] == adv[3] > 0 > adv[4] == adv[5]


def test_grpo_trains_exactly_the_sampled_positions_wherever_they_are(tiny_tokenizer: Any) -> None:
    (groups, _), _ = sample(tiny_tokenizer, solver)
    batch = groups_to_batch(groups)
    row = 0
    for g in groups:
        for tokens, mask, lp in zip(g.tokens.rows(), g.masks.rows(), g.inference_logprobs.rows(), strict=True):
            n = len(tokens)
            sampled = mask != -100
            assert np.array_equal(batch.loss_mask[row, :n].numpy() > 0, sampled)
            assert not batch.loss_mask[row, n:].any()
            assert np.array_equal(batch.tokens[row, :n].numpy(), tokens)
            np.testing.assert_allclose(batch.behaviour_logprobs[row, :n].numpy()[sampled], lp[sampled], atol=1e-7)
            runs = np.flatnonzero(np.diff(sampled.astype(int)) == 1)
            assert len(runs) == 2  # two sampled spans, environment tokens between and before them
            row += 1


def test_a_run_builds_an_episode_environment_from_its_env_section(tiny_tokenizer: Any, tmp_path: Any) -> None:
    from rollhub.envs.group.spec import load_environment_from_spec

    tiny_tokenizer.save_pretrained(tmp_path)
    kwargs = {"env": "calculator", "tokenizer": str(tmp_path), "max_tokens": 250, "turn_max_tokens": 100,
              "env_kwargs": {"lo": 2, "hi": 3}}  # fmt: skip
    env = load_environment_from_spec("episodes", kwargs)
    policy = ScriptedPolicy(env.renderer.tokenizer, solver)
    groups, metrics = env.sample(policy, 2, 2, "train", RNG)
    assert len(groups) == 2 and metrics["accuracy"] == 1.0
    assert assert_exact_rows(groups[0], policy.handed_out) == 4


def test_each_sampled_token_keeps_the_version_the_engine_reports_for_it(tiny_tokenizer: Any) -> None:
    # every turn is crossed by a push after its third token: versions k, k, k, then k + 1 (turn k handed out k-th)
    policy = ScriptedPolicy(tiny_tokenizer, solver, version_of=lambda k, i: 10 + k + (i >= 3))
    env = EpisodeGroupEnv(CalculatorEnv(), ChatRenderer(tiny_tokenizer), LIMITS)
    groups, _ = env.sample(policy, 2, 2, "train", RNG)
    turns: dict[tuple[tuple[int, ...], tuple[int, ...]], set[int]] = {}  # (prompt, ids) -> the turns that sent them
    for k, sent in enumerate(policy.handed_out):
        turns.setdefault((tuple(sent.prompt), tuple(sent.ids)), set()).add(k)
    for g in groups:
        oldest = min(int(v) for row in g.token_versions.rows() for v in row if v != -1)
        assert g.policy_version == oldest  # staleness by the oldest token
        for tokens, mask, versions in zip(g.tokens.rows(), g.masks.rows(), g.token_versions.rows(), strict=True):
            tokens, sampled = list(map(int, tokens)), np.asarray(mask) != -100
            assert np.all(np.asarray(versions)[~sampled] == -1)
            starts = np.flatnonzero(np.diff(np.r_[0, sampled.astype(int)]) == 1)
            ends = np.flatnonzero(np.diff(np.r_[sampled.astype(int), 0]) == -1) + 1
            for start, end in zip(starts, ends, strict=True):
                k = int(versions[start]) - 10
                assert k in turns[(tuple(tokens[:start]), tuple(tokens[start:end]))]
                assert list(versions[start:end]) == [10 + k + (i >= 3) for i in range(end - start)]
    spans = groups[0].meta["overrides"][0]["rollhub"]["versions"]  # the row record's [version, start, end) runs
    assert len({v for v, _, _ in spans}) >= 3  # two turns, each crossed by a push


def test_a_completion_with_a_version_per_token_short_is_refused(tiny_tokenizer: Any) -> None:
    tokens = EpisodeTokens([1, 2])
    with pytest.raises(TokenDriftError, match="3 sampled ids but 2 versions"):
        tokens.sampled(Completion((1, 2), (5, 6, 7), (-0.1, -0.2, -0.3), "x", "stop", versions=(4, 4)), None)
