"""Vectorized environment processes: per-instance faults, fragment boundaries, the split and the adaptive batch."""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from rollout_fakes import ValuePolicy

from rollhub.envs import EnvSpec
from rollhub.errors import ConfigError
from rollhub.experience import SampleFragment
from rollhub.rollout.protocols import SampleRequest
from rollhub.rollout.step.env_child import stack_observations
from rollhub.rollout.step.env_worker import Backoff, EnvWorker, EnvWorkerError, InlineEnvWorker
from rollhub.rollout.step.manager import StepManagerConfig, StepRolloutManager

FAST = Backoff(base_s=0.01)


def _manager(n_envs: int, processes: int, fragment_length: int = 4, **env: object) -> StepRolloutManager:
    config = StepManagerConfig(
        EnvSpec("rollout_fakes:GateEnv", env), n_envs=n_envs, env_processes=processes,
        fragment_length=fragment_length, backoff=FAST,
    )  # fmt: skip
    return StepRolloutManager(config, ValuePolicy, worker_id="t")


def _by_env(fragments: list[SampleFragment]) -> dict[int, list[SampleFragment]]:
    out: dict[int, list[SampleFragment]] = {}
    for f in fragments:
        out.setdefault(f.env_index, []).append(f)
    return out


@pytest.mark.parametrize("processes", [2, 0])
def test_instances_are_spread_over_processes_and_fragments_chain_per_environment(processes: int) -> None:
    manager = _manager(n_envs=5, processes=processes, fragment_length=3)
    fragments = []
    try:
        assert len(set(manager.env_pids())) == processes, "inline (0): no environment process at all"
        while min((len(v) for v in _by_env(fragments).values()), default=0) < 3 or len(_by_env(fragments)) < 5:
            fragments += manager.sample_batch(SampleRequest(0, "t", 0)).items
    finally:
        manager.shutdown()
    for index, frags in _by_env(fragments).items():
        assert all(f.length == 3 for f in frags)
        steps = np.concatenate([f.obs for f in frags])
        assert (steps[:, 0] == index).all(), "every step of a fragment comes from its own environment (seed = index)"
        np.testing.assert_array_equal(steps[:, 1], np.arange(len(steps)), "steps in order, none lost or repeated")
        np.testing.assert_array_equal(np.concatenate([f.rewards for f in frags]), steps[:, 1] + 1)
        for a, b in itertools.pairwise(frags):
            np.testing.assert_array_equal(a.bootstrap_obs, b.obs[0])


@pytest.mark.parametrize("processes", [1, 0])
def test_a_raising_instance_is_restarted_alone_and_its_episode_cut_as_truncated(processes: int) -> None:
    manager = _manager(n_envs=3, processes=processes, fragment_length=4, raise_seed=1, raise_at=3)
    fragments = []
    try:
        pids = manager.env_pids()
        while len(_by_env(fragments).get(1, [])) < 2 or len(_by_env(fragments).get(0, [])) < 2:
            result = manager.sample_batch(SampleRequest(0, "t", 0))
            fragments += result.items
        assert manager.env_pids() == pids, "an instance fault does not restart the process"
        assert manager.env_restarts() == 1
    finally:
        manager.shutdown()
    crashed = np.concatenate([f.obs for f in _by_env(fragments)[1]])
    # steps from t=0 and t=1 succeeded, the step from t=2 raised: it is dropped and the episode cut at t=1
    assert crashed[:2, 1].tolist() == [0, 1] and crashed[2, 1] == 0 and crashed[2, 0] != 1, "rebuilt, reseeded"
    truncated = np.concatenate([f.truncated for f in _by_env(fragments)[1]])
    assert truncated[:3].tolist() == [False, True, False]
    for neighbour in (0, 2):  # the other instances of the process never noticed
        steps = np.concatenate([f.obs for f in _by_env(fragments)[neighbour]])
        np.testing.assert_array_equal(steps[:, 1], np.arange(len(steps)))
        assert not np.concatenate([f.truncated for f in _by_env(fragments)[neighbour]]).any()


def test_a_killed_process_restarts_all_its_instances_and_cuts_their_episodes() -> None:
    manager = _manager(n_envs=4, processes=2, fragment_length=6)
    fragments = []
    try:
        # a crash cuts the step before the lost one, so the killed environments need two steps held first
        while min(manager.held_records()[:2]) < 3:
            fragments += manager.sample_batch(SampleRequest(0, "t", 0)).items
        victim, other = manager.env_pids()
        os.kill(victim, signal.SIGKILL)
        while min((len(v) for v in _by_env(fragments).values()), default=0) < 2 or len(_by_env(fragments)) < 4:
            fragments += manager.sample_batch(SampleRequest(0, "t", 0)).items
        assert manager.env_pids()[1] == other and manager.env_pids()[0] != victim
        assert manager.env_restarts() == 2
    finally:
        manager.shutdown()
    by_env = _by_env(fragments)
    for index in (0, 1):  # the instances of the killed process: one cut each
        assert np.concatenate([f.truncated for f in by_env[index]]).sum() == 1
    for index in (2, 3):
        assert not np.concatenate([f.truncated for f in by_env[index]]).any()


@pytest.mark.parametrize("kind", [EnvWorker, InlineEnvWorker])
def test_an_instance_that_keeps_failing_stops_the_worker_with_its_name(kind: type) -> None:
    worker = kind(EnvSpec("rollout_fakes:CountingEnv", {"raise_at": 1}), n_instances=2, seed=0,
                  backoff=Backoff(base_s=0.001, max_failures=2))  # fmt: skip
    try:
        worker.start()
        with pytest.raises(EnvWorkerError, match=r"instance \d .*failed 3 times in a row"):
            for _ in range(10):
                worker.send_step(np.zeros(2, np.int64))
                worker.recv_step()
    finally:
        worker.close()


@pytest.mark.parametrize("kind", [EnvWorker, InlineEnvWorker])
def test_instances_get_numpy_integer_actions_as_in_gymnasium_vectors(kind: type) -> None:
    worker = kind(EnvSpec("rollout_fakes:ActionTypeEnv"), n_instances=3, seed=0, backoff=FAST)
    try:
        worker.start()
        worker.send_step(np.array([2, 0, 1]))
        assert worker.recv_step().obs.tolist() == [[1, 2], [1, 0], [1, 1]]
    finally:
        worker.close()


def test_a_straggler_does_not_stall_the_other_half(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    # environments 2 and 3 (the second process) block until the gate file exists
    manager = _manager(n_envs=4, processes=2, fragment_length=5, gate=str(gate), gated=(2, 3))
    fragments, batches = [], []
    try:
        while len(_by_env(fragments).get(0, [])) < 4:
            result = manager.sample_batch(SampleRequest(0, "t", 0))
            fragments += result.items
            batches.append(result.inference_batch)
        assert 2 not in _by_env(fragments) and 3 not in _by_env(fragments)
        assert batches[0] == 4 and set(batches[1:]) == {2}, "after the first turn only the ready half is batched"
        gate.touch()
        while len(_by_env(fragments).get(3, [])) < 2:
            fragments += manager.sample_batch(SampleRequest(0, "t", 0)).items
    finally:
        manager.shutdown()
    for index in (2, 3):  # the straggler's steps are all there and in order once released
        steps = np.concatenate([f.obs for f in _by_env(fragments)[index]])
        np.testing.assert_array_equal(steps[:, 1], np.arange(len(steps)))


def test_a_bounded_wait_gathers_the_whole_batch_when_it_is_ready_in_time() -> None:
    config = StepManagerConfig(EnvSpec("rollout_fakes:GateEnv"), n_envs=4, env_processes=4, fragment_length=2,
                               batch_wait_s=30.0)  # fmt: skip
    manager = StepRolloutManager(config, ValuePolicy, worker_id="t")
    try:
        batches = [manager.sample_batch(SampleRequest(0, "t", 0)).inference_batch for _ in range(20)]
        # a generous bound is never reached: every turn waits for all four environments
        assert batches == [4] * 20
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [("env_processes", {"env_processes": 5}), ("env_processes", {"env_processes": -1}),
     ("batch_wait_s", {"batch_wait_s": -1.0}), ("inference_batch_size", {"inference_batch_size": 9})],
)  # fmt: skip
def test_bad_process_and_batching_settings_name_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=field):
        StepManagerConfig(EnvSpec("sleep"), n_envs=4, **kwargs)


def test_observations_of_a_vector_keep_their_dtype_and_ragged_ones_are_refused() -> None:
    same = stack_observations([np.full(3, i, np.float32) for i in range(4)])
    assert same.shape == (4, 3) and same.dtype == np.float32 and same[2, 0] == 2
    scalars = stack_observations([0, 5, 2])  # e.g. a Discrete observation space
    assert scalars.tolist() == [0, 5, 2] and scalars.dtype.kind == "i"
    with pytest.raises(ValueError, match="same shape"):
        stack_observations([np.zeros(3), np.zeros(2)])
