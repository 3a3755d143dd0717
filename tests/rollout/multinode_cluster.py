"""One multi-node scenario on a local Ray cluster (a head and two worker nodes on this machine); writes what it saw.

Usage: ``python multinode_cluster.py fleet|replay|learn RESULT.json WORKDIR``. ``tests/rollout/test_multinode.py`` runs
it in a process group of its own, so a multi-node cluster never meets the test session's local Ray runtime, and
everything it started can be killed at once. The script asserts nothing: it records node ids, fragments served,
counters and events, and the test decides. Every phase waits on a condition with a generous deadline.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import rollout_fakes
from ray.cluster_utils import Cluster

from rollhub.envs import EnvSpec
from rollhub.experience import SampleFragment
from rollhub.rollout.backends.base import FleetConfig
from rollhub.rollout.backends.ray import ActorWriter, FleetClient, start_replay_buffer
from rollhub.rollout.step.manager import StepManagerConfig, step_manager_factory
from rollhub.rollout.worker import RolloutWorkerConfig

STORE = 80 * 2**20  # object store per node: the fragments are small
PHASE_S = 240.0  # deadline of each waiting phase
START_ATTEMPTS = 3  # Ray gives a node 30 s (fixed) to register: on a loaded machine a start can miss it


class NodeStartFailed(Exception):
    """Ray could not start a node of the cluster: the scenario has done nothing yet and starts over."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def start_cluster(cluster: Cluster, node_resources: list[dict[str, float]]) -> list[Any]:
    """A head with no CPUs (the driver, fleet and statistics actors live there) and one 1-CPU node per entry;
    returns the worker nodes in that order."""
    add_node(cluster, num_cpus=0, include_dashboard=False)
    nodes = [add_node(cluster, num_cpus=1, resources=r) for r in node_resources]
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    ray.cloudpickle.register_pickle_by_value(rollout_fakes)
    return nodes


def add_node(cluster: Cluster, **node_args: Any) -> Any:
    """Start one node and wait until the cluster sees it; a node Ray could not start raises ``NodeStartFailed``.

    ``FAIL_NODE_STARTS=N`` in the environment fails the first N starts of this run after the node came up (as if it
    had missed Ray's deadline), so a test can show that a failed start is retried from scratch and leaves nothing."""
    try:
        node = cluster.add_node(object_store_memory=STORE, **node_args)
        cluster.wait_for_nodes(timeout=120)
    except Exception as e:
        raise NodeStartFailed(f"{type(e).__name__}: {e}") from e
    global _injected
    if _injected < int(os.environ.get("FAIL_NODE_STARTS", "0")):
        _injected += 1
        raise NodeStartFailed(f"injected failure {_injected}")
    return node


_injected = 0  # node starts failed on purpose so far (FAIL_NODE_STARTS)


def kill_session_except_me() -> list[int]:
    """Kill every process in this script's session but itself (``test_multinode`` starts it as a session leader):
    what a failed node start left running belongs to no node the cluster knows, so its shutdown cannot stop it.
    Run by hand from a shell (not a session leader), it kills nothing: the session is the shell's."""
    me = os.getpid()
    if os.getsid(0) != me:
        return []
    return rollout_fakes.kill_all([pid for pid in rollout_fakes.session_members(me) if pid != me])


def key(fragment: SampleFragment) -> str:
    """What tells two fragments apart (a fragment served twice has the same key)."""
    f = fragment
    return f"{f.worker_id}/{f.env_index}/{f.task}/{f.created_at!r}/{f.episode_ids[0]}"


def echo(version: int) -> dict[str, np.ndarray]:
    return {"v": np.array(float(version))}


def start_fleet(n_workers: int, replay: Any, step_s: float) -> FleetClient:
    spec = EnvSpec("sleep", {"step_s": step_s, "episode_length": 40})
    config = FleetConfig(
        n_workers=n_workers,
        worker_num_cpus=0.5,
        worker_resources={"rollout": 1},
        info_timeout_s=60.0,
        worker=RolloutWorkerConfig(max_staleness=1000),
    )
    manager_config = StepManagerConfig(spec, n_envs=1, fragment_length=16)
    manager = step_manager_factory(manager_config, rollout_fakes.WeightEchoPolicy)
    # a generous call timeout: an add waits out a restarting buffer instead of failing the worker
    return FleetClient.start(config, manager, ActorWriter(replay, timeout_s=300.0), timeout_s=120.0)


class Trainer:
    """Consumes batches one by one and publishes a new echo version every ``publish_every`` batches."""

    def __init__(self, replay: Any, fleet: FleetClient, publish_every: int = 8) -> None:
        self.replay, self.fleet, self.publish_every = replay, fleet, publish_every
        self.served: list[dict[str, Any]] = []
        self.version = 0
        fleet.publish(0, echo(0))

    def consume_until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + PHASE_S
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not reached within {PHASE_S} s ({len(self.served)} fragments served)")
            batch = ray.get(self.replay.next_batch.remote(5.0), timeout=PHASE_S)
            if batch is None:
                continue
            self.record(batch)
            if batch.step % self.publish_every == 0:
                self.version += 1
                self.fleet.publish(self.version, echo(self.version))

    def drain(self) -> None:
        """Serve whatever is still queued (batch size 1, so nothing stays behind)."""
        while (batch := ray.get(self.replay.next_batch.remote(0.0), timeout=120)) is not None:
            self.record(batch)

    def record(self, batch: Any) -> None:
        for f in batch.items:
            self.served.append(
                {"key": key(f), "worker": f.worker_id, "step": batch.step, "min_version": f.min_version, "task": f.task}
            )

    def count(self, worker: str) -> int:
        return sum(1 for s in self.served if s["worker"] == worker)


def stop_fleet(fleet: FleetClient, result: dict[str, Any]) -> None:
    """Record the fleet's last status (nodes, restarts, events), stop it (the senders drain), and record each
    worker's final counters (``items_sent``: what the buffer acknowledged)."""
    result["fleet_status"] = fleet.status()
    result["final_workers"] = fleet.stop()


def fleet_scenario(cluster: Cluster, workers: list[Any], workdir: Path, result: dict[str, Any]) -> None:
    """Two workers spread over two nodes; one node is removed while the trainer keeps consuming."""
    nodes = {node.node_id: node for node in workers}
    replay = start_replay_buffer(batch_size=1, max_staleness=1000, max_queued=64)
    fleet = start_fleet(2, replay, step_s=0.002)
    trainer = Trainer(replay, fleet)
    result.update(worker_nodes=sorted(nodes), head_node=cluster.head_node.node_id)
    try:
        trainer.consume_until(lambda: trainer.count("w0") >= 5 and trainer.count("w1") >= 5, "both workers produce")
        before = fleet.status()["workers"]
        result["nodes_before"] = {w["worker_id"]: w["node_id"] for w in before}
        victim = result["nodes_before"]["w1"]
        result["victim"] = victim
        result["version_at_removal"] = trainer.version
        result["served_before_removal"] = len(trainer.served)
        log(f"removing node {victim[:8]} (worker w1)")
        cluster.remove_node(nodes[victim])
        mark = len(trainer.served)

        def recovered() -> bool:
            after = trainer.served[mark:]
            replacement = sum(s["worker"].startswith("w1r") for s in after)
            return replacement >= 5 and sum(s["worker"] == "w0" for s in after) >= 5

        trainer.consume_until(recovered, "the replacement worker produces")
        stop_fleet(fleet, result)
        result["replay_status"] = ray.get(replay.status.remote(), timeout=120)  # before draining: what was added
        trainer.drain()
        result["served_before_removal_mark"] = mark
    finally:
        result["served"] = trainer.served
        fleet.stop()


def replay_scenario(cluster: Cluster, workers: list[Any], workdir: Path, result: dict[str, Any]) -> None:
    """A SQLite-backed buffer on node A; a worker on node B writes into it; node A is removed.

    Node B, which also offers the buffer's ``replay`` resource, joins only after the buffer started, so the
    buffer is certainly on A, and the only place it can restart is B."""
    home = workers[0]
    db = workdir / "replay.db"
    replay = start_replay_buffer(1, 1000, None, f"sqlite:///{db}", max_restarts=-1, resources={"replay": 1})
    result["status_before"] = ray.get(replay.status.remote(), timeout=120)  # on node A: the only one offering replay
    other = add_node(cluster, num_cpus=1, resources={"rollout": 2, "replay": 1})
    fleet = start_fleet(1, replay, step_s=0.005)
    trainer = Trainer(replay, fleet)
    result.update(home_node=home.node_id, other_node=other.node_id, head_node=cluster.head_node.node_id)
    try:
        trainer.consume_until(lambda: trainer.count("w0") >= 10, "the worker's fragments reach the trainer")
        # Fragments the buffer acknowledges while nobody consumes: they are certainly queued when its node goes.
        probes = [probe_fragment(i) for i in range(6)]
        ray.get(replay.add.remote(probes), timeout=120)
        result["probes"] = [key(p) for p in probes]
        result["queued_at_removal"] = ray.get(replay.status.remote(), timeout=120)
        result["last_step_before"] = trainer.served[-1]["step"]
        mark = len(trainer.served)
        result["served_before_removal_mark"] = mark
        log(f"removing node {home.node_id[:8]} (the buffer's)")
        cluster.remove_node(home)
        result["status_after"] = ray.get(replay.status.remote(), timeout=PHASE_S)

        def recovered() -> bool:
            after = trainer.served[mark:]
            return sum(s["task"].startswith("probe") for s in after) == len(probes) and trainer.count("w0") >= mark + 10

        trainer.consume_until(recovered, "the probes and new fragments are served after the restart")
        stop_fleet(fleet, result)
        trainer.drain()
        result["status_end"] = ray.get(replay.status.remote(), timeout=120)
    finally:
        result["served"] = trainer.served
        fleet.stop()


def probe_fragment(i: int) -> SampleFragment:
    z = np.zeros(4, np.float32)
    return SampleFragment(
        obs=np.full((4, 2), i, np.float32), actions=np.zeros(4, np.int64), rewards=z, terminated=z.astype(bool),
        truncated=z.astype(bool), logp=z, values=z, final_values=z, bootstrap_obs=np.zeros(2, np.float32),
        bootstrap_value=0.0, state_in=None, versions=np.zeros(4, np.int64), episode_ids=np.full(4, i, np.int64),
        worker_id="probe", task=f"probe-{i}",
    )  # fmt: skip


def learn_scenario(cluster: Cluster, workers: list[Any], workdir: Path, result: dict[str, Any]) -> None:
    """CartPole PPO with one worker on each node; the node of worker 1 is removed at update 15.

    Training goes on for at least 70 updates, and until the replacement of worker 1 has contributed to 3 batches:
    the survivor alone fills batches faster than Ray notices the lost node on a busy machine."""
    from rollhub.inference.mlp_policy import make_cartpole_policy
    from rollhub.train.ppo import PPOConfig, PPOLearner

    nodes = {node.node_id: node for node in workers}
    replay = start_replay_buffer(batch_size=8, max_staleness=1, max_queued=128)
    manager_config = StepManagerConfig(EnvSpec("CartPole-v1"), n_envs=3, fragment_length=64, seed=1)
    config = FleetConfig(
        n_workers=2,
        worker_num_cpus=0.5,
        worker_resources={"rollout": 1},
        info_timeout_s=60.0,
        worker=RolloutWorkerConfig(max_staleness=1),
    )
    policy = functools.partial(make_cartpole_policy, 64)
    fleet = FleetClient.start(config, step_manager_factory(manager_config, policy), ActorWriter(replay), 120.0)
    learner = PPOLearner(4, 2, PPOConfig(seed=1))
    result["batch_workers"] = []
    try:
        fleet.publish(0, learner.weights())
        deadline, update = math.inf, 0  # set when the node goes
        while update < 70 or sum(any(w.startswith("w1r") for w in ws) for ws in result["batch_workers"][16:]) < 3:
            if time.monotonic() > deadline:
                raise TimeoutError(f"w1's replacement was in under 3 batches {PHASE_S} s after its node went")
            batch = ray.get(replay.next_batch.remote(PHASE_S), timeout=PHASE_S + 60)
            if batch is None:
                raise TimeoutError(f"no batch within {PHASE_S} s at update {update}")
            result["batch_workers"].append(sorted({f.worker_id for f in batch.items}))
            learner.update(batch.items)
            fleet.publish(batch.step + 1, learner.weights())
            if update == 15:
                result["nodes_before"] = {w["worker_id"]: w["node_id"] for w in fleet.status()["workers"]}
                result["victim"] = result["nodes_before"]["w1"]
                log(f"removing node {result['victim'][:8]} (worker w1) at update {update}")
                cluster.remove_node(nodes[result["victim"]])
                deadline = time.monotonic() + PHASE_S
            update += 1
        result["returns"] = [e.ret for e in fleet.statistics().history()]
        result["fleet_status"] = fleet.status()
    finally:
        fleet.stop()


SCENARIOS = {
    "fleet": (fleet_scenario, [{"rollout": 2}, {"rollout": 2}]),
    "replay": (replay_scenario, [{"replay": 1}]),
    "learn": (learn_scenario, [{"rollout": 2}, {"rollout": 2}]),
}


def run(name: str, workdir: Path, result: dict[str, Any]) -> None:
    """Start a cluster, run the scenario on it, and take the cluster down, whatever happened."""
    scenario, resources = SCENARIOS[name]
    started = time.monotonic()
    cluster = Cluster(shutdown_at_exit=False)
    try:
        workers = start_cluster(cluster, resources)
        log(f"cluster up in {time.monotonic() - started:.1f} s")
        scenario(cluster, workers, workdir, result)
    except BaseException:
        try:
            take_down(cluster)
        except Exception as e:  # the scenario's own error is the one to report
            log(f"the cluster's shutdown failed too: {type(e).__name__}: {e}")
        raise
    take_down(cluster)


def take_down(cluster: Cluster) -> None:
    ray.shutdown()
    cluster.shutdown()
    log("cluster shut down")


def main() -> None:
    """Run the scenario; a node that Ray could not start (before the scenario did anything else, or while the replay
    scenario adds its second node) starts it over on a fresh cluster and work folder, at most ``START_ATTEMPTS``
    times. The result records each failed start."""
    name, out, workdir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    started = time.monotonic()
    failed_starts: list[str] = []
    result: dict[str, Any] = {}
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            result = {"failed_starts": failed_starts}
            folder = workdir / f"attempt-{attempt}"
            folder.mkdir()
            try:
                run(name, folder, result)
                break
            except NodeStartFailed as e:
                failed_starts.append(str(e))
                killed = kill_session_except_me()
                log(f"attempt {attempt}: a node did not start ({e}); killed {len(killed)} leftover processes")
                if attempt == START_ATTEMPTS:
                    raise
    except BaseException:
        result["error"] = traceback.format_exc()
        raise
    finally:
        result["elapsed_s"] = time.monotonic() - started
        out.write_text(json.dumps(result, default=str))
        log(f"{name} finished after {result['elapsed_s']:.1f} s")


if __name__ == "__main__":
    main()
