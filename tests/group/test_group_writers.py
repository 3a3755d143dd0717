from __future__ import annotations

from pathlib import Path

import pytest
from group_helpers import mock_curriculum

from rollhub.envs.group.scored import group_info
from rollhub.experience import Group
from rollhub.inference.torch_policy import LocalPolicy
from rollhub.rollout.group.files import (
    FileRolloutWriter,
    RolloutFileError,
    read_rollout_groups,
    read_rollout_records,
)
from rollhub.rollout.group.manager import GroupRolloutManager
from rollhub.rollout.protocols import SampleRequest
from rollhub.train.grpo import groups_to_batch
from rollhub.wire.group import group_from_json, group_to_item


def _calls(policy: LocalPolicy, n: int) -> list[list[Group]]:
    manager = GroupRolloutManager(mock_curriculum(), policy)
    out = []
    for version in range(n):
        groups = manager.sample_batch(SampleRequest(version, "w", lesson_id="easy", n_examples=2, seed=version)).items
        assert len(groups) == 2
        out.append(groups)
    return out


def _items(lines: list[list[Group]]) -> list[list[str]]:
    """Each line's groups as their JSON items (what must survive the file exactly)."""
    import orjson

    return [[orjson.dumps(group_to_item(g), option=orjson.OPT_SERIALIZE_NUMPY).decode() for g in gs] for gs in lines]


def test_groups_round_trip_exactly(tmp_path: Path, policy: LocalPolicy) -> None:
    calls = _calls(policy, 3)
    path = tmp_path / "sub" / "rollouts.jsonl"
    with FileRolloutWriter(path) as writer:
        for groups in calls:
            writer.write(groups)
        assert writer.lines_written == 3 and writer.groups_written == 6
    back = list(read_rollout_groups(path))
    assert _items(back) == _items(calls)
    assert [g.policy_version for gs in back for g in gs] == [0, 0, 1, 1, 2, 2]
    assert all(group_info(g)["worker_id"] == "w" for gs in back for g in gs)
    # The stored items are server items: the GRPO trainer reads them as they are.
    items = [it for rec in read_rollout_records(path) for it in rec["items"]]
    assert groups_to_batch([group_from_json(it) for it in items]).tokens.shape[0] == 24


def test_appending_and_writing_after_close(tmp_path: Path, policy: LocalPolicy) -> None:
    calls = _calls(policy, 2)
    path = tmp_path / "r.jsonl"
    for groups in calls:
        w = FileRolloutWriter(path, fsync=True)
        w.write(groups)
        w.close()
    assert len(list(read_rollout_groups(path))) == 2
    with pytest.raises(RolloutFileError, match="closed"):
        w.write(calls[0])
    with pytest.raises(RolloutFileError, match="Group objects, got dict at 0"):
        FileRolloutWriter(tmp_path / "x.jsonl").write([{"tokens": [[1]]}])  # type: ignore[list-item]


def test_torn_last_line_is_skipped_but_corruption_is_not(tmp_path: Path, policy: LocalPolicy) -> None:
    calls = _calls(policy, 2)
    path = tmp_path / "r.jsonl"
    with FileRolloutWriter(path) as w:
        for groups in calls:
            w.write(groups)
    text = path.read_text()
    path.write_text(text[:-25])  # a crash mid-line
    assert _items(list(read_rollout_groups(path))) == _items(calls[:1])
    lines = text.splitlines(keepends=True)
    path.write_text(lines[0][:-10] + "\n" + lines[1])
    with pytest.raises(RolloutFileError, match="line 1"):
        list(read_rollout_groups(path))
