"""The process fleet: each RolloutWorker a process of its own, the buffer and the statistics in this one."""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
from rollout_fakes import (
    FileFailingManager,
    WeightEchoPolicy,
    check_versions_as_loaded,
    drain_replay,
    echo_weights,
    publish_versions,
    wait_until,
)

from rollhub.envs import EnvSpec
from rollhub.rollout.backends.base import FleetConfig, FleetError
from rollhub.rollout.backends.local import LocalWriter
from rollhub.rollout.backends.processes import ProcessFleet
from rollhub.rollout.replay import ReplayBuffer
from rollhub.rollout.step.manager import StepManagerConfig, step_manager_factory
from rollhub.rollout.worker import RolloutWorkerConfig
from rollhub.run.sources import LocalReplaySource

SLEEP0 = EnvSpec("sleep", {"step_s": 0.0, "episode_length": 40})


def _echo_fleet(replay: ReplayBuffer, n_workers: int = 2, **worker: Any) -> ProcessFleet:
    worker.setdefault("drain_s", 1.0)
    manager = StepManagerConfig(SLEEP0, n_envs=2, env_processes=0, fragment_length=16)
    config = FleetConfig(n_workers=n_workers, supervise_every_s=0.05, worker=RolloutWorkerConfig(1000, **worker))
    return ProcessFleet(config, step_manager_factory(manager, WeightEchoPolicy), LocalWriter(replay))


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_workers_run_in_their_own_processes_tag_versions_as_loaded_and_lose_nothing_at_stop() -> None:
    # a small buffer: the workers' writes are refused part of the time and retried, and nothing is lost
    replay = ReplayBuffer(batch_size=1, max_staleness=1000, max_queued=3)
    fleet = _echo_fleet(replay, stats_every_s=0.01)
    items: list[Any] = []
    try:
        publish_versions(fleet, replay, items)
        wait_until(lambda: {e.worker_id for e in fleet.statistics().history()} == {"w0", "w1"}, "episodes of both")
        status = fleet.status()
    finally:
        infos = fleet.stop()
    items += drain_replay(replay)
    pids = [w["pid"] for w in status["workers"]]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert status["pipeline"]["env_steps"] == sum(w["pipeline"]["env_steps"] for w in status["workers"]) > 0
    check_versions_as_loaded(items)
    assert [i["state"] for i in infos] == ["stopped", "stopped"]
    # what the full buffer still refused when stop gave up draining is counted, never lost silently
    assert sum(i["items_sent"] for i in infos) == len(items)
    assert all(e.length == 40 for e in fleet.statistics().history())
    for pid in pids:
        wait_until(lambda pid=pid: _gone(pid), f"worker process {pid} to end")


def test_a_killed_worker_process_is_replaced_with_the_newest_weights() -> None:
    replay = ReplayBuffer(batch_size=1, max_staleness=1000, max_queued=10_000)
    fleet = _echo_fleet(replay, n_workers=1)
    try:
        fleet.publish(0, echo_weights(0))
        wait_until(lambda: fleet.status()["workers"][0]["state"] == "running", "the worker to run")
        victim = fleet.status()["workers"][0]["pid"]
        fleet.publish(7, echo_weights(7))
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: fleet.status()["restarts"] == [1], "the restart")
        wait_until(lambda: fleet.status()["workers"][0]["state"] == "running", "the replacement to run")
        worker = fleet.status()["workers"][0]
        drain_replay(replay)
        wait_until(lambda: bool(replay.status()["queue_size"]), "a fragment of the replacement")
        fresh = [f for f in drain_replay(replay) if f.worker_id == "w0r1"]
    finally:
        fleet.stop()
    assert worker["worker_id"] == "w0r1" and worker["loaded_version"] == 7 and worker["pid"] != victim
    assert fresh and all((-f.logp == 7).all() for f in fresh)
    assert any(f"worker process {victim} exited (exit code -9)" in e for e in fleet.events)


def test_publishing_to_a_dead_worker_process_does_not_fail_the_trainer() -> None:
    replay = ReplayBuffer(batch_size=1, max_staleness=1000, max_queued=10_000)
    manager = StepManagerConfig(SLEEP0, n_envs=1, env_processes=0, fragment_length=16)
    config = FleetConfig(n_workers=1, supervise_every_s=3600.0)  # no replacement during the test
    fleet = ProcessFleet(config, step_manager_factory(manager, WeightEchoPolicy), LocalWriter(replay))
    try:
        fleet.publish(0, echo_weights(0))
        victim = fleet.status()["workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: fleet.status()["workers"][0]["state"] == "failed", "the fleet to see the worker gone")
        fleet.publish(1, echo_weights(1))  # its pipe is broken: nothing is sent, nothing raised
        worker = fleet.status()["workers"][0]
    finally:
        fleet.stop()
    assert worker["state"] == "failed" and f"worker process {victim} exited (exit code -9)" in worker["error"]


def _failing_fleet(tmp_path: Path, failures: int, max_restarts: int, at_start: bool = False) -> ProcessFleet:
    budget = tmp_path / "budget"
    budget.write_text(str(failures))
    config = FleetConfig(n_workers=1, supervise_every_s=0.02, max_restarts=max_restarts)
    factory = functools.partial(FileFailingManager, str(budget), at_start)
    return ProcessFleet(config, factory, LocalWriter(ReplayBuffer(1, 1)))


def test_a_failed_worker_is_restarted_until_its_slot_runs_out_then_the_source_raises(tmp_path: Path) -> None:
    fleet = _failing_fleet(tmp_path, failures=10**6, max_restarts=2)
    try:
        fleet.publish(0, echo_weights(0))
        wait_until(lambda: bool(fleet.abandoned), "the slot to be given up")
        with pytest.raises(FleetError, match=r"all 1 worker slots exhausted their restarts .*restart limit reached"):
            LocalReplaySource(ReplayBuffer(1, 1), fleet).next_batch(0.0)
        events = list(fleet.events)
    finally:
        fleet.stop()
    assert fleet.restarts == [2]
    assert sum("failed: RuntimeError: simulator lost" in e for e in events) == 3


def test_a_worker_that_cannot_start_raises_its_own_error_and_leaves_nothing_running(tmp_path: Path) -> None:
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(OSError, match="cannot open the simulator for w0"):
        _failing_fleet(tmp_path, failures=0, max_restarts=1, at_start=True)
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in children]
    for process in new:  # only multiprocessing's resource tracker may stay, as it does for any spawn
        assert "resource_tracker" in " ".join(process.cmdline()), process.cmdline()


ORPHAN = """
import sys, time
sys.path[:0] = {path!r}
import numpy as np
from rollout_fakes import WeightEchoPolicy, check_versions_as_loaded, drain_replay, echo_weights, wait_until
from rollhub.envs import EnvSpec
from rollhub.rollout.backends.base import FleetConfig
from rollhub.rollout.backends.local import LocalWriter
from rollhub.rollout.backends.processes import ProcessFleet
from rollhub.rollout.replay import ReplayBuffer
from rollhub.rollout.step.manager import StepManagerConfig, step_manager_factory

if __name__ == "__main__":
    manager = StepManagerConfig(EnvSpec("sleep", {{"step_s": 0.001}}), n_envs=2, env_processes=1)
    fleet = ProcessFleet(FleetConfig(n_workers=1), step_manager_factory(manager, WeightEchoPolicy),
                         LocalWriter(ReplayBuffer(1, 1000, 10_000)))
    fleet.publish(0, {{"v": np.array(0.0)}})
    while not (worker := fleet.status()["workers"][0])["env_pids"]:
        time.sleep(0.05)
    print(worker["pid"], *worker["env_pids"], flush=True)
    time.sleep(600)
"""


def test_worker_processes_whose_fleet_died_stop_by_themselves(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN.format(path=sys.path))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2, "the worker's pid and its environment process's"
        parent.kill()  # no stop, no clean-up: the control pipe just ends
        parent.wait(60)
        for pid in pids:
            wait_until(lambda pid=pid: _gone(pid), f"process {pid} to end")
    finally:
        parent.kill()
        for process in psutil.Process().children(recursive=True):
            if process.pid in pids:
                process.kill()
