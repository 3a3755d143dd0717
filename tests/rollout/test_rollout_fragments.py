"""Fragment assembly: the ``fragment_length + 1`` rule, alignment of rewards and done flags, crashes."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading

import numpy as np
import pytest
from rollout_fakes import StepCounterPolicy, ValuePolicy, timer_slack_ns

from rollhub.envs import EnvSpec
from rollhub.errors import ConfigError
from rollhub.experience import SampleFragment
from rollhub.rollout.protocols import SampleRequest
from rollhub.rollout.step.env_worker import Backoff, EnvWorker, EnvWorkerError, set_timer_slack
from rollhub.rollout.step.fragments import FragmentColumns
from rollhub.rollout.step.manager import StepManagerConfig, StepRolloutManager


def _fields(t: int, n: int = 1, version: int = 0, reward_in: float = 0.0, **flags: bool) -> dict:
    return {"logp": -1.0, "value": float(t), "version": version, "episode_id": 0, "reward_in": reward_in,
            "terminated_in": flags.get("terminated_in", False), "truncated_in": flags.get("truncated_in", False),
            "final_value_in": 0.0}  # fmt: skip


def _append(cols: FragmentColumns, t: int, n: int = 1, replace: tuple = (), **kw: object) -> list[SampleFragment]:
    obs = np.array([[t, j] for j in range(n)])
    return cols.append(obs, np.full(n, t), _fields(t, n, **kw), replace=replace)  # type: ignore[arg-type]


def test_columns_cut_at_length_plus_one_and_chain() -> None:
    cols = FragmentColumns(3, [5])
    out = [_append(cols, t, reward_in=100 + t) for t in range(7)]
    assert [len(f) for f in out] == [0, 0, 0, 1, 0, 0, 1]
    first, second = out[3][0], out[6][0]
    assert first.obs[:, 0].tolist() == [0, 1, 2] and first.length == 3 and first.env_index == 5
    # record t+1 carries the reward of the transition out of step t; record 0's incoming reward is ignored
    assert first.rewards.tolist() == [101, 102, 103]
    assert first.bootstrap_obs.tolist() == [3, 0] and first.bootstrap_value == 3.0
    assert second.obs[:, 0].tolist() == [3, 4, 5], "the extra step starts the next fragment"
    assert second.rewards.tolist() == [104, 105, 106]


def test_columns_reset_when_a_step_is_too_old() -> None:
    cols = FragmentColumns(4, [0, 1])
    for t in range(3):
        _append(cols, t, n=2, version=t)
    assert cols.drop_older_than(0) == 0 and cols.held() == [3, 3]
    assert cols.drop_older_than(1) == 4 and cols.held() == [0, 0]
    assert [f.versions.tolist() for f in [*_append(cols, 3, n=2, version=3)]] == []


def test_a_replaced_record_keeps_each_environment_in_order() -> None:
    """Environment 1 replaces its newest record twice (a crash): the two environments then hold different
    counts, are written at their own rows, and each still cuts its own records in order."""
    cols = FragmentColumns(3, [0, 1])
    fragments = []
    for t in range(10):
        fragments += _append(cols, t, n=2, replace=(1,) if t in (2, 3) else ())
    by_env = {j: [f.obs[:, 0].tolist() for f in fragments if f.env_index == j] for j in (0, 1)}
    assert by_env[0] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert by_env[1] == [[0, 3, 4], [5, 6, 7]], "records 1 and 2 were replaced by 2 and then 3"
    assert cols.held() == [1, 2]
    assert all(f.obs[:, 1].tolist() == [f.env_index] * 3 for f in fragments)


def _manager(
    end: str, length: int = 5, fragment_length: int = 4, policy: type = ValuePolicy, **env: object
) -> StepRolloutManager:
    spec = EnvSpec("rollout_fakes:CountingEnv", {"length": length, "end": end, **env})
    config = StepManagerConfig(spec, n_envs=1, fragment_length=fragment_length, backoff=Backoff(base_s=0.01))
    return StepRolloutManager(config, policy, worker_id="t")


def _collect(manager: StepRolloutManager, n: int, version: int = 0) -> list:
    fragments, events = [], []
    while len(fragments) < n:
        result = manager.sample_batch(SampleRequest(version, "t", 0))
        fragments += result.items
        events += result.events
    return fragments


@pytest.mark.parametrize("end", ["terminate", "truncate"])
def test_rewards_and_done_flags_are_aligned(end: str) -> None:
    manager = _manager(end)
    try:
        frags = _collect(manager, 3)
    finally:
        manager.shutdown()
    obs = np.concatenate([f.obs for f in frags])
    rewards = np.concatenate([f.rewards for f in frags])
    terminated = np.concatenate([f.terminated for f in frags])
    truncated = np.concatenate([f.truncated for f in frags])
    final_values = np.concatenate([f.final_values for f in frags])
    # the step taken from obs [episode, t] earns t + 1 and ends the episode when t + 1 == 5
    np.testing.assert_array_equal(rewards, obs[:, 1] + 1)
    ends = obs[:, 1] == 4
    np.testing.assert_array_equal(terminated, ends if end == "terminate" else np.zeros_like(ends))
    np.testing.assert_array_equal(truncated, ends if end == "truncate" else np.zeros_like(ends))
    # truncation bootstraps from the final observation [episode, 5] (value 10 * episode + 5); termination not
    expected_final = np.where(ends & (end == "truncate"), 10 * obs[:, 0] + 5, 0.0)
    np.testing.assert_array_equal(final_values, expected_final)
    for a, b in itertools.pairwise(frags):
        np.testing.assert_array_equal(a.bootstrap_obs, b.obs[0])
        assert a.bootstrap_value == b.values[0]
    assert [f.episode_ids.tolist() for f in frags[:2]] == [[1, 1, 1, 1], [1, 2, 2, 2]]


def test_steps_carry_the_version_of_their_request() -> None:
    manager = _manager("terminate", fragment_length=3)
    try:
        versions = [manager.sample_batch(SampleRequest(v, "t", 0)) for v in (0, 0, 1, 1, 2, 3, 4)]
    finally:
        manager.shutdown()
    fragments = [f for r in versions for f in r.items]
    assert [f.versions.tolist() for f in fragments] == [[0, 0, 1], [1, 2, 3]]


def test_stale_steps_are_dropped_before_they_form_a_fragment() -> None:
    manager = _manager("terminate", fragment_length=3)
    try:
        for v in (0, 0, 5):
            assert manager.sample_batch(SampleRequest(v, "t", 0)).items == []
        result = manager.sample_batch(SampleRequest(6, "t", min_version=5))
        frags = _collect(manager, 1, version=6)
    finally:
        manager.shutdown()
    assert result.dropped_steps == 2
    assert frags[0].min_version >= 5


def test_raising_environment_is_restarted_and_the_episode_truncated() -> None:
    manager = _manager("terminate", length=100, fragment_length=4, raise_at=3)
    try:
        frags = _collect(manager, 2)
        assert manager.env_restarts() >= 1
    finally:
        manager.shutdown()
    first = frags[0]
    # steps from t=0 and t=1 succeeded; the step from t=2 raised: it is dropped, and the step from t=1 is cut
    # as truncated, bootstrapping from the value of obs t=2 (the last observation the episode reached).
    assert first.obs[:2, 1].tolist() == [0, 1]
    assert first.truncated.tolist()[:2] == [False, True]
    assert not first.terminated.any()
    assert first.final_values[1] == pytest.approx(10 * 0 + 2)
    assert first.episode_ids[2] != first.episode_ids[1]
    assert first.obs[2, 1] == 0, "the restarted process starts a new episode"


def test_killed_env_process_is_restarted_and_cut_as_truncated() -> None:
    manager = _manager("terminate", length=1000, fragment_length=8)
    try:
        for _ in range(3):
            manager.sample_batch(SampleRequest(0, "t", 0))
        old_pid = manager.env_pids()[0]
        os.kill(old_pid, signal.SIGKILL)
        frags = _collect(manager, 2)
        assert manager.env_pids()[0] != old_pid and manager.env_restarts() == 1
    finally:
        manager.shutdown()
    steps = np.concatenate([f.truncated for f in frags])
    assert steps.sum() == 1 and not np.concatenate([f.terminated for f in frags]).any()


def test_fragment_keeps_the_recurrent_state_at_its_start() -> None:
    manager = _manager("truncate", length=5, fragment_length=3, policy=StepCounterPolicy)
    try:
        frags = _collect(manager, 4)
    finally:
        manager.shutdown()
    for f in frags:
        # the state counts the policy's steps in the episode, which is the observation's t; it resets per episode
        assert f.state_in is not None and f.state_in.tolist() == [f.obs[0, 1]]


@pytest.mark.skipif(sys.platform != "linux", reason="timer slack is a Linux setting")
@pytest.mark.parametrize("slack", [1000, 20_000, None])
def test_env_processes_run_with_the_configured_timer_slack(slack: int | None) -> None:
    config = StepManagerConfig(EnvSpec("rollout_fakes:SlackEnv"), n_envs=2, fragment_length=2, timer_slack_ns=slack)
    manager = StepRolloutManager(config, ValuePolicy, worker_id="t")
    try:
        fragments = _collect(manager, 2)
    finally:
        manager.shutdown()
    seen = {int(obs[0]) for f in fragments for obs in [*f.obs, f.bootstrap_obs]}
    # None leaves the inherited value (this test process's own slack) untouched
    assert seen == {slack if slack is not None else timer_slack_ns()}


@pytest.mark.skipif(sys.platform != "linux", reason="timer slack is a Linux setting")
@pytest.mark.parametrize("slack", [1000, 20_000, None])
def test_environments_stepped_in_the_workers_thread_run_with_the_configured_timer_slack(slack: int | None) -> None:
    """With env_processes=0 the thread that builds and steps the environments gets the slack: here a thread of its
    own that starts from a slack no setting uses, so the test process's main thread keeps its own."""
    config = StepManagerConfig(EnvSpec("rollout_fakes:SlackEnv"), n_envs=2, env_processes=0, fragment_length=2,
                               timer_slack_ns=slack)  # fmt: skip
    seen: set[int] = set()
    before = 37_000

    def run() -> None:
        assert set_timer_slack(before) and timer_slack_ns() == before
        manager = StepRolloutManager(config, ValuePolicy, worker_id="t")
        try:
            seen.update(int(obs[0]) for f in _collect(manager, 2) for obs in [*f.obs, f.bootstrap_obs])
        finally:
            manager.shutdown()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert seen == {slack if slack is not None else before}


def test_timer_slack_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="timer_slack_ns"):
        StepManagerConfig(EnvSpec("sleep"), timer_slack_ns=0)


def test_observations_larger_than_a_pipe_buffer_arrive_whole() -> None:
    worker = EnvWorker(EnvSpec("rollout_fakes:BigObsEnv", {"size": 100_000}), n_instances=2)  # 1.6 MB per message
    try:
        assert worker.start().shape == (2, 100_000) and worker.start().sum() == 0
        for t in range(1, 4):
            worker.send_step(np.array([t * 10, t * 20]))
            result = worker.recv_step()
            assert not result.crashed and result.rewards.tolist() == [t * 10, t * 20]
            assert result.obs.shape == (2, 100_000) and (result.obs == t).all()
        with pytest.raises(EnvWorkerError, match="one per instance"):
            worker.send_step(np.array([1, 2, 3]))
    finally:
        worker.close()


@pytest.mark.parametrize("state", [None, np.arange(6, dtype=np.float32).reshape(2, 3)])
@pytest.mark.parametrize("obs", [
    np.arange(12, dtype=np.uint8).reshape(3, 2, 2),
    np.arange(12, dtype=">f4").reshape(2, 3, 2).transpose(1, 0, 2),  # big-endian, not contiguous
    np.arange(12, dtype="<f4").reshape(3, 2, 2),  # the same dtype in the other byte order
    np.array([{"a": 1}, {"b": 2}, None]),
])  # fmt: skip
def test_a_fragment_survives_pickling_whole_and_writable(state: np.ndarray | None, obs: np.ndarray) -> None:
    import dataclasses
    import pickle

    frag = SampleFragment(
        obs=obs, actions=np.array([[0.5, 1], [2, 3], [4, 5]]), rewards=np.array([1, 2, 3], np.float32),
        terminated=np.array([False, True, False]), truncated=np.array([True, False, False]),
        logp=np.full(3, -0.5, np.float32), values=np.ones(3, np.float32), final_values=np.zeros(3, np.float32),
        bootstrap_obs=obs[-1], bootstrap_value=2.5, state_in=state, versions=np.array([3, 3, 4]),
        episode_ids=np.array([7, 7, 8]), worker_id="w", env_index=2, task="t", created_at=123.0,
    )  # fmt: skip
    back = pickle.loads(pickle.dumps(frag, protocol=5))
    for f in dataclasses.fields(frag):
        a, b = getattr(frag, f.name), getattr(back, f.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist(), f.name
            assert b.flags.writeable, f.name
        else:
            assert a == b, f.name
