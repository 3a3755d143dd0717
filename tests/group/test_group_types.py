from __future__ import annotations

import json

import pytest

from rollhub.errors import InvalidInput
from rollhub.rollout_types import (
    Rollout,
    RolloutBatch,
    RolloutBatchStats,
    RolloutGroup,
    RolloutMetadata,
)
from rollhub.wire.group import group_from_json

META = RolloutMetadata(worker_id="w-1", timestamp=1700000000.125, weight_step=7)


def _rollout(resp: tuple[int, ...], reward: float, correct: bool = False, meta=META) -> Rollout:
    return Rollout(
        env_name="arith",
        env_example_id="3+4",
        prompt_tokens=(1, 6, 13, 7, 16),
        response_tokens=resp,
        response_logprobs=tuple(-0.1 * (i + 1) for i in range(len(resp))),
        episode_reward=reward,
        correct=correct,
        metadata=meta,
    )


def test_group_converts_to_the_server_item_layout() -> None:
    group = RolloutGroup((_rollout((3, 10, 2), 1.0, True), _rollout((4,), 0.25)))
    item = group.to_item()
    assert item["tokens"][0] == [1, 6, 13, 7, 16, 3, 10, 2]
    assert item["masks"][0] == [-100] * 5 + [3, 10, 2]
    assert item["masks"][1] == [-100] * 5 + [4]
    assert item["inference_logprobs"][1] == [1.0] * 5 + [-0.1]
    assert item["scores"] == [1.0, 0.25]
    assert item["policy_version"] == 7
    group_from_json(item)  # the buffer's own validator accepts it


def test_item_round_trip_is_exact_through_json() -> None:
    group = RolloutGroup((_rollout((3, 10, 2), 1.0, True), _rollout((4, 5), 1 / 3)))
    back = RolloutGroup.from_item(json.loads(json.dumps(group.to_item())))
    assert back == group


def test_batch_round_trip() -> None:
    groups = (
        RolloutGroup((_rollout((3,), 0.5),)),
        RolloutGroup((_rollout((2,), 0.0), _rollout((3, 2), 1.0))),
    )
    batch = RolloutBatch(groups=groups, metadata=META, lesson_id="add")
    assert RolloutBatch.from_items(batch.to_items(), META, "add") == batch
    stats = RolloutBatchStats.of(batch, "add")
    assert stats.n_rollouts == 3 and stats.mean_reward == pytest.approx(0.5)


def test_items_from_other_producers_split_on_the_mask() -> None:
    item = {
        "tokens": [[5, 6, 7, 8]],
        "masks": [[-100, -100, 7, 8]],
        "scores": [0.5],
        "inference_logprobs": None,
    }
    (r,) = RolloutGroup.from_item(item).rollouts
    assert r.prompt_tokens == (5, 6) and r.response_tokens == (7, 8) and r.metadata is None


def test_a_group_mixing_metadata_is_refused() -> None:
    other = RolloutMetadata("w-2", 1.0, 7)
    group = RolloutGroup((_rollout((3,), 1.0), _rollout((3,), 1.0, meta=other)))
    with pytest.raises(InvalidInput, match="mixes"):
        group.to_item()


def test_logprob_count_must_match_tokens() -> None:
    with pytest.raises(InvalidInput, match="log-probs"):
        Rollout("e", "x", (1,), (2, 3), (-0.5,), 0.0)
