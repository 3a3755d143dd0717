"""A Ray fleet of group workers shares one curriculum actor: every worker samples from it and reports to it."""

from __future__ import annotations

import time

import pytest
import ray
from group_worker_fakes import ManagerFactory, RecordingPolicy, curriculum, weights
from rollout_fakes import Collector

from rollhub.envs.group.scored import group_info
from rollhub.rollout.backends.base import FleetConfig
from rollhub.rollout.backends.ray import ActorWriter, FleetClient
from rollhub.rollout.worker import RolloutWorkerConfig

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_session")]


def _wait(predicate, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_two_fleet_workers_share_one_curriculum_and_both_report_to_it() -> None:
    config = curriculum(eval_frequency=1)
    sink = ray.remote(Collector).options(num_cpus=0).remote()
    fleet = FleetClient.start(
        FleetConfig(n_workers=2, worker_num_cpus=0.5, worker=RolloutWorkerConfig(max_rollouts=2)),
        ManagerFactory(config),
        ActorWriter(sink),
        curriculum=config,
    )
    groups: list = []
    try:
        handle = fleet.curriculum()
        fleet.publish(0, weights(RecordingPolicy(), 0.0))
        _wait(lambda: all(w["state"] == "finished" for w in fleet.status()["workers"]), "both workers to finish")
        _wait(lambda: sum(w["items_sent"] for w in fleet.status()["workers"]) == 12, "the senders to drain")
        # each worker: two training calls of 12 sequences, and a full evaluation at its turn 1
        _wait(
            lambda: ray.get(handle.state_dict.remote())["lessons"]["easy"]["n_samples"] == 2 * 2 * 12,
            "both workers' training statistics",
        )
        state = ray.get(handle.state_dict.remote())
        groups = ray.get(sink.take.remote())
    finally:
        fleet.stop()
    assert {group_info(g)["worker_id"] for g in groups} == {"w0", "w1"} and len(groups) == 12
    assert state["lessons"]["easy"]["eval_step"] == 1 and state["lessons"]["hard"]["eval_success"] is not None
