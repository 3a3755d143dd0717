"""The Ray fleet end to end: versions as loaded, staleness bound, supervision, learning under failures."""

from __future__ import annotations

import functools
import os
import signal
import time

import numpy as np
import pytest
import ray
from rollout_fakes import Collector, WeightEchoPolicy

from rollhub.envs import EnvSpec
from rollhub.inference.mlp_policy import make_cartpole_policy
from rollhub.rollout.backends.base import FleetConfig, FleetError
from rollhub.rollout.backends.ray import ActorWriter, FleetClient, start_replay_buffer
from rollhub.rollout.step.env_worker import Backoff
from rollhub.rollout.step.manager import StepManagerConfig, step_manager_factory
from rollhub.rollout.worker import RolloutWorkerConfig
from rollhub.train.ppo import PPOConfig, PPOLearner

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]

SLEEP0 = EnvSpec("sleep", {"step_s": 0.0, "episode_length": 40})


def _echo_fleet(writer: ActorWriter, max_staleness: int, n_workers: int = 2) -> FleetClient:
    config = StepManagerConfig(SLEEP0, n_envs=2, fragment_length=16)
    return FleetClient.start(
        FleetConfig(n_workers=n_workers, worker_num_cpus=0.5, worker=RolloutWorkerConfig(max_staleness)),
        step_manager_factory(config, WeightEchoPolicy),
        writer,
    )


def _echo(version: int) -> dict[str, np.ndarray]:
    return {"v": np.array(float(version))}


def test_steps_are_tagged_with_the_version_actually_loaded() -> None:
    sink = ray.remote(Collector).options(num_cpus=0).remote()
    fleet = _echo_fleet(ActorWriter(sink), max_staleness=1000)
    items: list = []
    try:
        fleet.publish(0, _echo(0))
        deadline = time.monotonic() + 300
        while len({f.worker_id for f in items}) < 2 and time.monotonic() < deadline:  # both workers up
            items += ray.get(sink.take.remote())
            time.sleep(0.05)
        for version in range(1, 31):
            fleet.publish(version, _echo(version))
            time.sleep(0.05)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(f.min_version == 30 for f in items):
            items += ray.get(sink.take.remote())
            time.sleep(0.1)
    finally:
        fleet.stop()
    assert any(f.min_version == 30 for f in items), "the newest version reached the fragments"
    for f in items:
        np.testing.assert_array_equal(f.logp, -f.versions.astype(np.float32))  # tag == weights in use
        assert np.all(np.diff(f.versions) >= 0)
    assert len({int(v) for f in items for v in f.versions}) > 5
    assert {f.worker_id for f in items} == {"w0", "w1"}


def test_trainer_never_receives_a_fragment_older_than_max_staleness() -> None:
    replay = start_replay_buffer(batch_size=4, max_staleness=1, max_queued=64)
    fleet = _echo_fleet(ActorWriter(replay), max_staleness=1)
    ages = []
    try:
        fleet.publish(0, _echo(0))
        for i in range(40):
            if i == 5:  # a pause lets a backlog of one version build up: it has to age out, not reach the trainer
                time.sleep(1.0)
            batch = ray.get(replay.next_batch.remote(120.0))
            assert batch is not None, "the fleet kept producing"
            ages += [batch.step - f.min_version for f in batch.items]
            fleet.publish(batch.step + 1, _echo(batch.step + 1))
        dropped_at_source = sum(w["dropped_steps"] for w in fleet.status()["workers"])
        dropped_in_buffer = ray.get(replay.status.remote())["stale_dropped_total"]
    finally:
        fleet.stop()
        ray.kill(replay)
    assert max(ages) <= 1 and min(ages) >= 0
    assert dropped_at_source + dropped_in_buffer > 0, "the bound was exercised"


def test_dead_fleet_is_an_error_not_a_hang() -> None:
    sink = ray.remote(Collector).options(num_cpus=0).remote()
    fleet = _echo_fleet(ActorWriter(sink), max_staleness=1, n_workers=1)
    fleet.publish(0, _echo(0))
    fleet.check()
    ray.kill(fleet.actor)
    # ray.kill is asynchronous: the actor may answer a call or two before it is gone. Once it is, every call is a
    # FleetError naming the cause (a dead actor), never the client's call timeout.
    with pytest.raises(FleetError, match="dead") as checked:
        for _ in range(200):
            fleet.check()
            time.sleep(0.05)
    with pytest.raises(FleetError) as published:
        fleet.publish(1, _echo(1))
    assert "did not answer" not in str(checked.value) + str(published.value)
    fleet.stop()


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else 0.0


def _answering(fleet: FleetClient, slot: str) -> dict:
    """The info of the worker in ``slot`` (``w0``, or its replacement ``w0r1``...) once it answers with its
    environments (a worker busy past the status call's timeout shows as dead, without them)."""
    deadline = time.monotonic() + 300
    while True:
        for w in fleet.status()["workers"]:
            if (w.get("worker_id") == slot or str(w.get("worker_id")).startswith(f"{slot}r")) and w.get("env_pids"):
                return w
        assert time.monotonic() < deadline, f"no worker of slot {slot} answered the fleet's status"
        time.sleep(0.2)


def test_fleet_survives_killed_env_process_and_worker_and_ppo_still_learns() -> None:
    replay = start_replay_buffer(batch_size=8, max_staleness=1, max_queued=128)
    config = StepManagerConfig(EnvSpec("CartPole-v1"), n_envs=3, fragment_length=64, seed=1)
    fleet = FleetClient.start(
        FleetConfig(n_workers=2, worker_num_cpus=0.5, worker=RolloutWorkerConfig(max_staleness=1)),
        step_manager_factory(config, functools.partial(make_cartpole_policy, 64)),
        ActorWriter(replay),
    )
    learner = PPOLearner(4, 2, PPOConfig(seed=1))
    killed_env = killed_worker = None
    try:
        fleet.publish(0, learner.weights())
        for update in range(70):
            batch = ray.get(replay.next_batch.remote(120.0))
            assert batch is not None, f"no batch after update {update}"
            learner.update(batch.items)
            fleet.publish(batch.step + 1, learner.weights())
            if update == 15:
                killed_env = _answering(fleet, "w0")["env_pids"][0]
                os.kill(killed_env, signal.SIGKILL)
            if update == 30:
                killed_worker = ray.get(fleet.actor.workers.remote())[1]
                ray.kill(killed_worker, no_restart=True)
        history = fleet.statistics().history()
        # the replacement worker may still be starting (a new process, its imports, its environments) when the
        # surviving worker has made the last batches alone: wait for every slot to run, however busy the machine
        deadline = time.monotonic() + 300
        status = fleet.status()
        while {w["state"] for w in status["workers"]} != {"running"}:
            assert time.monotonic() < deadline, f"workers not all running: {status['workers']}"
            time.sleep(0.2)
            status = fleet.status()
    finally:
        fleet.stop()
        ray.kill(replay)
    assert status["restarts"][1] >= 1 and any("slot 1" in e for e in status["events"])
    w0 = next(w for w in status["workers"] if str(w["worker_id"]).startswith("w0"))
    assert killed_env not in w0["env_pids"] and any("restarted" in e for e in w0["events"])
    assert {w["state"] for w in status["workers"]} == {"running"}
    assert status["pipeline"]["env_steps"] > 0 and status["pipeline"]["inference_s"] > 0
    first, last = _mean([e.ret for e in history[:20]]), _mean([e.ret for e in history[-20:]])
    assert last > max(2 * first, 100), (first, last)


def test_fleet_whose_workers_cannot_start_is_an_error_not_a_hang() -> None:
    sink = ray.remote(Collector).options(num_cpus=0).remote()
    broken = StepManagerConfig(EnvSpec("NoSuchEnv-v0"), n_envs=1, backoff=Backoff(base_s=0.01, max_failures=1))
    fleet = FleetClient.start(
        FleetConfig(n_workers=1, worker_num_cpus=0.5, max_restarts=1),
        step_manager_factory(broken, WeightEchoPolicy),
        ActorWriter(sink),
    )
    try:
        deadline = time.monotonic() + 60
        with pytest.raises(FleetError, match="cannot produce") as info:
            while time.monotonic() < deadline:
                fleet.check()
                time.sleep(0.2)
        assert "restart limit" in str(info.value)
    finally:
        fleet.stop()
