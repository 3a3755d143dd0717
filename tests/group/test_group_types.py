"""Scored completions as Groups: the Atropos item layout, exact round trips, stamps and statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollhub.envs.group.scored import (
    AbortedCompletionError,
    GroupStats,
    correct_flags,
    drop_aborted,
    group_info,
    make_group,
    response_lengths,
    stamp,
)
from rollhub.experience import Group
from rollhub.inference.base import Completion, FinishReason
from rollhub.wire.group import check_group, group_from_json, group_to_item


def _completion(resp: tuple[int, ...], finish: FinishReason = "stop") -> Completion:
    lps = tuple(-0.1 * (i + 1) for i in range(len(resp)))
    return Completion((1, 6, 13, 7, 16), resp, lps, "x", finish)


def _group() -> Group:
    comps = [_completion((3, 10, 2)), _completion((4,))]
    return make_group("arith", "3+4", comps, [1.0, 0.25], [True, False])


def test_group_has_the_server_item_layout() -> None:
    group = stamp(_group(), policy_version=7, worker_id="w-1", timestamp=1700000000.125)
    assert group.tokens.data.dtype == np.int32 and group.size == 2
    item = group_to_item(group)
    assert item["tokens"][0].tolist() == [1, 6, 13, 7, 16, 3, 10, 2]
    assert item["masks"][0].tolist() == [-100] * 5 + [3, 10, 2]
    assert item["masks"][1].tolist() == [-100] * 5 + [4]
    assert item["inference_logprobs"][1].tolist() == [1.0] * 5 + [-0.1]
    assert item["scores"].tolist() == [1.0, 0.25]
    assert item["policy_version"] == 7
    assert item["group_overrides"]["rollhub"] == {
        "env_name": "arith",
        "example_id": "3+4",
        "correct": [True, False],
        "worker_id": "w-1",
        "timestamp": 1700000000.125,
    }
    check_group(group)  # the buffer's own check accepts it


def test_item_round_trip_is_exact_through_json() -> None:
    group = stamp(_group(), 3, "w", 1.5)
    text = json.dumps(group_to_item(group), default=lambda a: a.tolist())
    back = group_from_json(json.loads(text))
    assert back.policy_version == 3 and group_info(back) == group_info(group)
    for name in ("tokens", "masks", "inference_logprobs"):
        assert [r.tolist() for r in getattr(back, name).rows()] == [r.tolist() for r in getattr(group, name).rows()]
    assert back.scores.tolist() == group.scores.tolist()


def test_stats_lengths_and_flags() -> None:
    group = _group()
    assert response_lengths(group).tolist() == [3, 1]
    assert correct_flags(group).tolist() == [True, False]
    stats = GroupStats.of([group, make_group("arith", "1+1", [_completion((2,))], [0.5], [False])], "add")
    assert stats.n_sequences == 3 and stats.mean_reward == pytest.approx(1.75 / 3)
    assert stats.accuracy == pytest.approx(1 / 3) and stats.mean_response_tokens == pytest.approx(5 / 3)
    assert stats.informative_groups == 0.5  # the one-sequence group has no spread
    assert stats.metrics("eval")["eval.add.n_sequences"] == 3.0
    assert GroupStats.of([], "add").n_sequences == 0


def test_groups_from_other_producers_have_no_rollhub_fields() -> None:
    item = {"tokens": [[5, 6, 7, 8]], "masks": [[-100, -100, 7, 8]], "scores": [0.5]}
    group = group_from_json(item)
    assert group_info(group) == {} and correct_flags(group).tolist() == [False]
    assert response_lengths(group).tolist() == [2]


def test_drop_aborted_leaves_out_every_prompt_with_an_aborted_completion() -> None:
    ok, aborted, cut = _completion((3,)), _completion((4,), "abort"), _completion((5,), "length")
    kept, n_aborted = drop_aborted(["a", "b", "c", "d"], [[ok, ok], [ok, aborted], [cut, ok], [aborted, aborted]])
    assert kept == [("a", [ok, ok]), ("c", [cut, ok])] and n_aborted == 3
    assert drop_aborted([], []) == ([], 0)
    with pytest.raises(ValueError, match="2 examples but 1 completion lists"):
        drop_aborted(["a", "b"], [[ok]])


def test_make_group_refuses_an_aborted_completion() -> None:
    comps = [_completion((3,)), _completion((4,), "abort")]
    with pytest.raises(AbortedCompletionError, match=r"completion 1 of example '3\+4'.*drop_aborted") as err:
        make_group("arith", "3+4", comps, [1.0, 0.0], [True, False])
    assert err.value.field == "finish_reason" and err.value.index == 1
