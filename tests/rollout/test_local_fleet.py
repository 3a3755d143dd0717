"""The local fleet: worker threads in this process, no Ray runtime, the Ray fleet's guarantees and supervision."""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

import psutil
import pytest
import ray
from rollout_fakes import (
    WeightEchoPolicy,
    check_versions_as_loaded,
    drain_replay,
    echo_weights,
    publish_versions,
    wait_until,
)

from rollhub.envs import EnvSpec
from rollhub.errors import ConfigError, InvalidInput
from rollhub.rollout.backends.base import FleetConfig, FleetError
from rollhub.rollout.backends.local import LocalFleet, LocalWriter
from rollhub.rollout.protocols import SampleRequest, SampleResult
from rollhub.rollout.replay import ReplayBuffer
from rollhub.rollout.step.manager import StepManagerConfig, step_manager_factory
from rollhub.rollout.worker import RolloutWorkerConfig
from rollhub.run.sources import LocalReplaySource

SLEEP0 = EnvSpec("sleep", {"step_s": 0.0, "episode_length": 40})


def _echo_fleet(replay: ReplayBuffer, max_staleness: int = 1000, n_workers: int = 2, **worker: Any) -> LocalFleet:
    manager = StepManagerConfig(SLEEP0, n_envs=2, env_processes=0, fragment_length=16)
    config = FleetConfig(n_workers=n_workers, worker=RolloutWorkerConfig(max_staleness, **worker))
    return LocalFleet(config, step_manager_factory(manager, WeightEchoPolicy), LocalWriter(replay))


def test_every_step_carries_the_version_its_worker_had_loaded_and_no_ray_runtime_starts() -> None:
    ray_before = ray.is_initialized()  # other tests of the session may have started one
    replay = ReplayBuffer(batch_size=1, max_staleness=1000)
    fleet = _echo_fleet(replay)
    items: list[Any] = []
    try:
        publish_versions(fleet, replay, items)
    finally:
        infos = fleet.stop()
    items += drain_replay(replay)
    assert ray.is_initialized() == ray_before  # the local fleet neither starts nor needs a Ray runtime
    check_versions_as_loaded(items)
    assert sum(i["items_sent"] for i in infos) == len(items)  # stop drained every queued fragment


def test_published_weights_are_one_read_only_copy_the_trainer_cannot_change_afterwards() -> None:
    replay = ReplayBuffer(batch_size=1, max_staleness=1000)
    fleet = _echo_fleet(replay, n_workers=1)
    weights = echo_weights(3)
    try:
        fleet.publish(3, weights)
        weights["v"][...] = 99.0  # the trainer reuses its buffers after publishing
        wait_until(lambda: bool(replay.status()["queue_size"]), "a fragment")
        fragment = drain_replay(replay)[0]
        with pytest.raises(InvalidInput, match="not newer than the last published 3"):
            fleet.publish(3, echo_weights(3))
    finally:
        fleet.stop()
    assert set((-fragment.logp).tolist()) == {3.0}


class FailingManager:
    """Fails its first ``sample_batch`` while ``failures[0] > 0`` (shared by every instance, counted down)."""

    def __init__(self, failures: list[int], worker_id: str) -> None:
        self.failures, self.worker_id, self.weights = failures, worker_id, None

    def update_model(self, weights: Any) -> None:
        self.weights = weights

    def sample_batch(self, request: SampleRequest) -> SampleResult:
        if self.failures[0] > 0:
            self.failures[0] -= 1
            raise RuntimeError("simulator lost")
        time.sleep(0.001)
        return SampleResult(items=[], env_steps=1, timings={})

    def shutdown(self) -> None:
        pass


def _failing_fleet(failures: int, max_restarts: int) -> LocalFleet:
    config = FleetConfig(n_workers=1, supervise_every_s=0.01, max_restarts=max_restarts)
    return LocalFleet(config, functools.partial(FailingManager, [failures]), LocalWriter(ReplayBuffer(1, 1)))


def test_a_failed_worker_is_replaced_with_the_newest_weights() -> None:
    fleet = _failing_fleet(failures=1, max_restarts=3)
    try:
        fleet.publish(0, echo_weights(0))
        fleet.publish(1, echo_weights(1))
        wait_until(lambda: fleet.status()["restarts"] == [1], "the restart")
        wait_until(lambda: fleet.workers()[0].info()["state"] == "running", "the replacement to run")
        status = fleet.status()
        fleet.check()  # a slot with restarts left is not a problem
    finally:
        fleet.stop()
    assert status["workers"][0]["worker_id"] == "w0r1" and status["workers"][0]["loaded_version"] == 1
    assert any("slot 0 failed: RuntimeError: simulator lost; restarted (restart 1)" in e for e in status["events"])


def test_a_slot_out_of_restarts_makes_the_source_raise_instead_of_waiting_forever() -> None:
    fleet = _failing_fleet(failures=10**6, max_restarts=2)
    replay = ReplayBuffer(batch_size=1, max_staleness=1)
    try:
        fleet.publish(0, echo_weights(0))
        wait_until(lambda: bool(fleet.abandoned), "the slot to be given up")
        with pytest.raises(FleetError, match=r"all 1 worker slots exhausted their restarts .*restart limit reached"):
            LocalReplaySource(replay, fleet).next_batch(0.0)
    finally:
        fleet.stop()
    assert fleet.restarts == [2]


def test_a_replacement_that_cannot_be_built_is_retried_until_the_restarts_run_out() -> None:
    built = []

    def factory(worker_id: str) -> FailingManager:
        built.append(worker_id)
        if len(built) > 1:
            raise OSError("no display")
        return FailingManager([1], worker_id)

    fleet = LocalFleet(
        FleetConfig(n_workers=1, supervise_every_s=0.01, max_restarts=2), factory, LocalWriter(ReplayBuffer(1, 1))
    )
    try:
        fleet.publish(0, echo_weights(0))
        wait_until(lambda: bool(fleet.abandoned), "the slot to be given up")
    finally:
        fleet.stop()
    assert built == ["w0", "w0r1", "w0r2"]
    assert sum("replacement failed to start (no display)" in e for e in fleet.events) == 2


def test_episodes_reach_the_shared_statistics_and_status_sums_the_workers() -> None:
    replay = ReplayBuffer(batch_size=1, max_staleness=1000)
    fleet = _echo_fleet(replay, n_workers=2, stats_every_s=0.01)
    try:
        fleet.publish(0, echo_weights(0))
        wait_until(lambda: {e.worker_id for e in fleet.statistics().history()} == {"w0", "w1"}, "episodes of both")
    finally:
        fleet.stop()
    status = fleet.status()
    assert [e.length for e in fleet.statistics().history()] == [40] * len(fleet.statistics().history())
    assert status["pipeline"]["env_steps"] == sum(w["pipeline"]["env_steps"] for w in status["workers"]) > 0
    assert status["restarts"] == [0, 0]


def test_bad_uses_are_refused_with_the_reason() -> None:
    manager = step_manager_factory(StepManagerConfig(SLEEP0, n_envs=1, env_processes=0), WeightEchoPolicy)
    writer = LocalWriter(ReplayBuffer(1, 1))
    with pytest.raises(ConfigError, match="use the Ray fleet for a curriculum"):
        LocalFleet(FleetConfig(n_workers=1), manager, writer, curriculum=object())

    def broken(worker_id: str) -> Any:
        raise OSError("cannot open the simulator")

    started = threading.active_count()
    with pytest.raises(OSError, match="cannot open the simulator"):
        LocalFleet(FleetConfig(n_workers=2), broken, writer)
    assert threading.active_count() == started  # nothing was left running


def test_environment_processes_of_local_workers_run_and_end_with_the_fleet() -> None:
    replay = ReplayBuffer(batch_size=1, max_staleness=1000)
    manager = StepManagerConfig(SLEEP0, n_envs=2, env_processes=2, fragment_length=8)
    fleet = LocalFleet(FleetConfig(n_workers=1), step_manager_factory(manager, WeightEchoPolicy), LocalWriter(replay))
    try:
        fleet.publish(0, echo_weights(0))
        wait_until(lambda: replay.status()["queue_size"] >= 4, "fragments from the environment processes")
        pids = fleet.status()["workers"][0]["env_pids"]
    finally:
        fleet.stop()
    assert len(pids) == 2 and os.getpid() not in pids
    for pid in pids:  # stopped with the fleet (a zombie has exited too)
        wait_until(lambda pid=pid: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
              f"process {pid} to end")  # fmt: skip
