"""The replay buffer, the buffer table with the fragment rule: per-fragment staleness and partial writes."""

from __future__ import annotations

import numpy as np
import pytest

from rollhub.buffer import ExperienceBuffer, FragmentRule, Table
from rollhub.experience import SampleFragment
from rollhub.rollout.replay import PartialWrite, ReplayBuffer


def _fragment(versions: list[int]) -> SampleFragment:
    n = len(versions)
    z = np.zeros(n, np.float32)
    return SampleFragment(
        obs=np.zeros((n, 2), np.float32), actions=np.zeros(n, np.int64), rewards=z, terminated=z.astype(bool),
        truncated=z.astype(bool), logp=z, values=z, final_values=z, bootstrap_obs=np.zeros(2, np.float32),
        bootstrap_value=0.0, state_in=None, versions=np.array(versions, np.int64), episode_ids=np.zeros(n, np.int64),
    )  # fmt: skip


def test_no_served_fragment_is_older_than_max_staleness() -> None:
    replay = ReplayBuffer(batch_size=2, max_staleness=1)
    served = []
    for step in range(6):
        # every round offers one fragment at the current version and stragglers up to 3 versions old;
        # the oldest step of a fragment decides its age
        replay.add([_fragment([step, step]), _fragment([max(step - 3, 0), step]), _fragment([max(step - 1, 0)] * 2)])
        batch = replay.next_batch()
        assert batch is not None and batch.step == step
        served.append(batch)
    for batch in served:
        assert all(batch.step - f.min_version <= 1 for f in batch.items)
    assert replay.status()["stale_dropped_total"] > 0


def test_full_buffer_reports_how_many_it_took() -> None:
    replay = ReplayBuffer(batch_size=1, max_staleness=1, max_queued=2)
    with pytest.raises(PartialWrite) as info:
        replay.add([_fragment([0]), _fragment([0]), _fragment([0])])
    assert info.value.accepted == 2
    assert replay.status()["queue_size"] == 2


def test_the_replay_buffer_is_the_shared_table_with_the_fragment_rule() -> None:
    replay = ReplayBuffer(batch_size=2, max_staleness=0, in_process=True)
    assert type(replay.table) is Table and isinstance(replay.table.rule, FragmentRule)
    assert not isinstance(replay.table, ExperienceBuffer)  # no env registry, no group ingest: no way around them
    replay.add([_fragment([0]), _fragment([0]), _fragment([0])])
    assert replay.publish_version(1).stale_dropped == 3  # the table's staleness gate, as in the Atropos buffer
    replay.add([_fragment([1]), _fragment([1, 1])])
    batch = replay.next_batch()
    assert batch is not None and [f.min_version for f in batch.items] == [1, 1]
