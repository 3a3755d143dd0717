"""The Ray replay buffer keeps the serving rule: it admits only fragments it can send, and a batch that fails to
pickle stays queued, first in line, counted in ``serve_failures``."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import numpy as np
import pytest

from rollhub.errors import InvalidInput
from rollhub.experience import SampleFragment

replay_module = pytest.importorskip("rollhub.rollout.replay", reason="the replay buffer needs the ray extra")
ReplayBuffer = replay_module.ReplayBuffer


def fragment(version: int, **extra: Any) -> SampleFragment:
    z = np.zeros(2, np.float32)
    return SampleFragment(
        obs=np.zeros((2, 2), np.float32), actions=np.zeros(2, np.int64), rewards=z, terminated=z.astype(bool),
        truncated=z.astype(bool), logp=z, values=z, final_values=z, bootstrap_obs=np.zeros(2, np.float32),
        bootstrap_value=0.0, state_in=None, versions=np.array([version] * 2, np.int64),
        episode_ids=np.zeros(2, np.int64), **extra,
    )  # fmt: skip


def test_the_replay_buffer_refuses_what_it_could_not_send_and_puts_a_failed_batch_back() -> None:
    replay = ReplayBuffer(batch_size=2, max_staleness=10)
    with pytest.raises(InvalidInput, match=r"items\[1\] cannot be sent"):
        replay.add([fragment(0), fragment(0, task=threading.Lock())])  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"items\[0\] is a dict"):
        replay.add([{"obs": 1}])  # type: ignore[list-item]
    assert replay.status()["queue_size"] == 0  # nothing of a refused call was queued
    replay.add([fragment(0)])
    replay.table.put(fragment(0, task=threading.Lock()), size=1, policy_version=0)  # past admission
    with pytest.raises(TypeError):
        replay.next_batch()
    status = replay.status()
    assert (status["queue_size"], status["current_step"], status["serve_failures"]) == (2, 0, 1)
    gids = [e.gid for e in replay.table.queued()]
    bad = replay.table.storage.payloads(gids)[1]
    object.__setattr__(bad, "task", "mended")  # once it can be sent, the same batch is served whole, as step 0
    batch = replay.next_batch()
    assert batch is not None and batch.step == 0 and [f.task for f in batch.items] == ["", "mended"]
    pickle.loads(pickle.dumps(batch))
    assert replay.status()["queue_size"] == 0


def test_an_in_process_buffer_hands_fragments_over_as_they_are_unless_it_stores_them(tmp_path: Any) -> None:
    replay = ReplayBuffer(batch_size=2, max_staleness=10, in_process=True)
    lock = threading.Lock()  # never pickles: nothing in this buffer's path needs it to
    first, second = fragment(0), fragment(0, task=lock)
    replay.add([first, second])
    batch = replay.next_batch()
    assert batch is not None and batch.items[0] is first and batch.items[1].task is lock
    with pytest.raises(InvalidInput, match=r"items\[0\] is a dict"):
        replay.add([{"obs": 1}])  # type: ignore[list-item]
    stored = ReplayBuffer(batch_size=1, max_staleness=10, storage=f"sqlite:///{tmp_path}/r.db", in_process=True)
    with pytest.raises(InvalidInput, match=r"items\[0\] cannot be sent"):
        stored.add([fragment(0, task=lock)])
    assert stored.status()["queue_size"] == 0
