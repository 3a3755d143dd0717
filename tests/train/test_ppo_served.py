"""``train_ppo`` trains on every batch its source serves: the staleness bound is the replay buffer's guard (against
the versions the loop publishes to it), never a second filter in the loop, which only measures the lag."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rollhub.experience import SampleFragment
from rollhub.rollout.replay import ReplayBuffer
from rollhub.run.sources import LocalReplaySource
from rollhub.train.ppo import PPOConfig, PPOLearner, PPOState, train_ppo
from tests.train.train_fakes import RecordingSource


def fragment(versions: list[int]) -> SampleFragment:
    n = len(versions)
    z = np.zeros(n, np.float32)
    return SampleFragment(
        obs=np.zeros((n, 2), np.float32), actions=np.zeros(n, np.int64), rewards=z, terminated=z.astype(bool),
        truncated=z.astype(bool), logp=np.full(n, -0.7, np.float32), values=z, final_values=z,
        bootstrap_obs=np.zeros(2, np.float32), bootstrap_value=0.0, state_in=None,
        versions=np.array(versions, np.int64), episode_ids=np.zeros(n, np.int64),
    )  # fmt: skip


class Published:
    def __init__(self) -> None:
        self.versions: list[int] = []

    def publish(self, version: int, weights: Mapping[str, np.ndarray]) -> None:
        self.versions.append(version)


def learner() -> PPOLearner:
    return PPOLearner(2, 2, PPOConfig(hidden=8, epochs=1, minibatches=1))


def test_a_guarded_buffers_batches_are_trained_whole_and_the_guard_drops_the_stale() -> None:
    replay = ReplayBuffer(batch_size=2, max_staleness=1, in_process=True)
    replay.add([fragment([0, 0]) for _ in range(5)])  # two batches, and one that ages past the bound at version 2
    source, publisher, state = RecordingSource(LocalReplaySource(replay)), Published(), PPOState()
    reason = train_ppo(learner(), source, publisher, state, stop_reason=lambda: None,
                       after_update=lambda s, stats: "done" if s.version == 2 else None, wait_s=0.0)  # fmt: skip
    assert reason == "done" and publisher.versions == [0, 1, 2] and replay.status()["policy_version"] == 2
    assert [(v, len(b)) for v, b in source.handed] == [(0, 2), (1, 2)]
    assert state.trained_steps == 8, "every served fragment was trained on"
    assert state.max_staleness_seen == 1
    assert replay.status()["stale_dropped_total"] == 1, "the buffer's guard dropped the fragment that aged past it"
    assert replay.next_batch() is None


def test_the_loop_measures_the_lag_of_what_it_is_served_and_filters_nothing() -> None:
    class Served:
        def __init__(self) -> None:
            self.batches = [[fragment([0, 0]), fragment([3, 3])]]

        def next_batch(self, wait_s: float) -> list[SampleFragment] | None:
            return self.batches.pop(0) if self.batches else None

        def publish_version(self, version: int) -> None:
            pass

    state = PPOState(version=5)
    seen: list[dict[str, float]] = []
    train_ppo(learner(), Served(), Published(), state, stop_reason=lambda: None,
              after_update=lambda s, stats: seen.append(stats) or "done", wait_s=0.0)  # fmt: skip
    assert state.trained_steps == 4 and seen[0]["samples"] == 4.0 and seen[0]["staleness"] == 5.0
    assert state.max_staleness_seen == 5 and state.version == 6


def test_a_checkpointed_state_with_the_old_trainer_drop_count_restores() -> None:
    values = {"version": 7, "trained_steps": 70, "stale_dropped": 3, "max_staleness_seen": 1}
    assert PPOState.restore(values) == PPOState(version=7, trained_steps=70, max_staleness_seen=1)
