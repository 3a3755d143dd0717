from __future__ import annotations

from pathlib import Path

import pytest
from group_helpers import mock_curriculum

from rollhub.inference.torch_policy import LocalPolicy
from rollhub.rollout.group_manager import GroupRolloutManager
from rollhub.rollout.group_writers import (
    FileRolloutWriter,
    RolloutFileError,
    read_rollout_batches,
    read_rollout_records,
)
from rollhub.train.grpo import items_to_batch


def _batches(policy: LocalPolicy, n: int):
    manager = GroupRolloutManager(mock_curriculum(), policy)
    out = []
    for step in range(n):
        batch, _ = manager.sample_batch("easy", 2, 3, "train", step, weight_step=step, worker_id="w")
        assert batch is not None
        out.append(batch)
    return out


def test_batches_round_trip_exactly(tmp_path: Path, policy: LocalPolicy) -> None:
    batches = _batches(policy, 3)
    path = tmp_path / "sub" / "rollouts.jsonl"
    with FileRolloutWriter(path) as writer:
        for b in batches:
            writer.write_batch(b)
        assert writer.batches_written == 3
    assert list(read_rollout_batches(path)) == batches
    # The stored items are server items: the GRPO trainer reads them as they are.
    items = [it for rec in read_rollout_records(path) for it in rec["items"]]
    assert items_to_batch(items).tokens.shape[0] == 18


def test_appending_and_writing_after_close(tmp_path: Path, policy: LocalPolicy) -> None:
    batches = _batches(policy, 2)
    path = tmp_path / "r.jsonl"
    for b in batches:
        w = FileRolloutWriter(path, fsync=True)
        w.write_batch(b)
        w.close()
    assert len(list(read_rollout_batches(path))) == 2
    with pytest.raises(RolloutFileError, match="closed"):
        w.write_batch(batches[0])


def test_torn_last_line_is_skipped_but_corruption_is_not(tmp_path: Path, policy: LocalPolicy) -> None:
    batches = _batches(policy, 2)
    path = tmp_path / "r.jsonl"
    with FileRolloutWriter(path) as w:
        for b in batches:
            w.write_batch(b)
    text = path.read_text()
    path.write_text(text[:-25])  # a crash mid-line
    assert list(read_rollout_batches(path)) == batches[:1]
    lines = text.splitlines(keepends=True)
    path.write_text(lines[0][:-10] + "\n" + lines[1])
    with pytest.raises(RolloutFileError, match="line 1"):
        list(read_rollout_batches(path))
