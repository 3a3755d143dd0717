"""Rollout fleet throughput against the ideal, and the time to broadcast weights.

Run: ``python benchmarks/rollout.py`` (local Ray, 2 CPUs). Prints one table:

* CartPole-v1: fleet environment steps/s next to a plain single-process gymnasium loop with the same policy.
* A synthetic environment that sleeps ``step_s`` per step: fleet steps/s next to the ideal ``n_envs / step_s``.
* Broadcasting ``--broadcast-mb`` of weights to 4 workers: from ``publish`` until every worker has loaded it.
"""

from __future__ import annotations

import argparse
import functools
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

import gymnasium
import numpy as np
import ray
import torch

from rollhub.envs import EnvSpec
from rollhub.envs.builtin import SleepEnv
from rollhub.rollout.env_worker import set_timer_slack
from rollhub.rollout.fleet import FleetClient, FleetConfig
from rollhub.rollout.protocols import PolicyStep
from rollhub.rollout.replay import start_replay_buffer
from rollhub.rollout.step_manager import StepManagerConfig, step_manager_factory
from rollhub.rollout.worker import RolloutWorkerConfig
from rollhub.rollout.writers import ActorWriter
from rollhub.train.ppo import PPOLearner, make_cartpole_policy


class HoldingPolicy:
    """A constant policy that keeps whatever weights it is given (measures transport, not a model copy)."""

    def __init__(self) -> None:
        self.weights: Mapping[str, np.ndarray] = {}

    def act(self, obs: np.ndarray, state: np.ndarray | None) -> PolicyStep:
        n = obs.shape[0]
        return PolicyStep(np.zeros(n, np.int64), np.zeros(n, np.float32), np.zeros(n, np.float32))

    def value(self, obs: np.ndarray) -> np.ndarray:
        return np.zeros(obs.shape[0], np.float32)

    def initial_state(self) -> None:
        return None

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        self.weights = weights


def env_step_seconds(step_s: float, timer_slack_ns: int | None, n: int = 500) -> float:
    """The sleeping environment's own mean step time in this process, with the timer slack the fleet's
    environment processes use (the OS overshoots short sleeps)."""
    env = SleepEnv(step_s=step_s, episode_length=10**9)
    env.reset(seed=0)
    result: list[float] = []

    def run() -> None:  # timer slack is per thread: measure in a fresh one
        set_timer_slack(timer_slack_ns)
        start = time.perf_counter()
        for _ in range(n):
            env.step(0)
        result.append((time.perf_counter() - start) / n)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


def plain_loop_steps_per_s(seconds: float) -> float:
    """One process, one CartPole, the same MLP policy, one observation per forward pass."""
    policy = make_cartpole_policy(64, seed=0)
    policy.load_weights(PPOLearner(4, 2).weights())
    env = gymnasium.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        action = policy.act(obs[None], None).actions[0]
        obs, _, terminated, truncated, _ = env.step(int(action))
        if terminated or truncated:
            obs, _ = env.reset()
        steps += 1
    return steps / (time.perf_counter() - start)


def fleet_steps_per_s(
    manager: StepManagerConfig, policy_factory: Any, weights: Mapping[str, np.ndarray], n_workers: int, seconds: float
) -> float:
    """Environment steps/s of a fleet writing into a replay buffer that a thread drains, after a warm-up."""
    replay = start_replay_buffer(batch_size=4, max_staleness=10**9, max_queued=10_000)
    fleet = FleetClient.start(
        FleetConfig(n_workers=n_workers, worker_num_cpus=2.0 / n_workers, worker=RolloutWorkerConfig(10**9)),
        step_manager_factory(manager, policy_factory),
        ActorWriter(replay),
    )
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            ray.get(replay.next_batch.remote(0.2))

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    try:
        fleet.publish(0, weights)

        def total_steps() -> float:
            return sum(w["pipeline"]["env_steps"] for w in fleet.status()["workers"])

        deadline = time.monotonic() + 60
        while total_steps() < 1000 and time.monotonic() < deadline:  # all envs up and stepping
            time.sleep(0.2)
        s0, t0 = total_steps(), time.perf_counter()
        time.sleep(seconds)
        s1, t1 = total_steps(), time.perf_counter()
        return (s1 - s0) / (t1 - t0)
    finally:
        stop.set()
        drainer.join()
        fleet.stop()
        ray.kill(replay)


def broadcast_seconds(megabytes: int, n_workers: int, repeats: int) -> list[float]:
    """Seconds from ``publish`` until all ``n_workers`` have loaded the version, per repeat."""
    sink = start_replay_buffer(batch_size=1, max_staleness=10**9)
    manager = StepManagerConfig(EnvSpec("sleep", {"step_s": 0.001}), n_envs=1, fragment_length=1000)
    fleet = FleetClient.start(
        FleetConfig(n_workers=n_workers, worker_num_cpus=0.0), step_manager_factory(manager, HoldingPolicy),
        ActorWriter(sink),
    )  # fmt: skip
    n = megabytes * 2**20 // 4
    times = []
    try:
        workers = ray.get(fleet.actor.workers.remote())
        for version in range(repeats + 1):
            weights = {"layer0": np.random.default_rng(version).standard_normal(n, dtype=np.float32)}
            start = time.perf_counter()
            fleet.publish(version, weights)
            while not all(v == version for v in ray.get([w.loaded_version.remote() for w in workers])):
                time.sleep(0.002)
            if version > 0:  # version 0 also waits for the workers to start
                times.append(time.perf_counter() - start)
    finally:
        fleet.stop()
        ray.kill(sink)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0, help="measurement window per throughput figure")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cartpole-envs", type=int, default=4, help="envs per worker on CartPole")
    p.add_argument("--sleep-envs", type=int, default=4, help="envs per worker on the sleeping env")
    p.add_argument("--sleep-batch", type=int, default=1, help="inference_batch_size on the sleeping env")
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--broadcast-mb", type=int, default=100)
    p.add_argument(
        "--os-timer-slack", action="store_true", help="run env processes with the OS default timer slack (50 µs)"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=1024 * 2**20, log_to_driver=False)
    try:
        plain = plain_loop_steps_per_s(args.seconds)
        cart = StepManagerConfig(EnvSpec("CartPole-v1"), n_envs=args.cartpole_envs, fragment_length=64)
        fleet_cart = fleet_steps_per_s(
            cart, functools.partial(make_cartpole_policy, 64), PPOLearner(4, 2).weights(), args.workers, args.seconds
        )
        n_sleep = args.workers * args.sleep_envs
        sleep = StepManagerConfig(
            EnvSpec("sleep", {"step_s": args.step_ms / 1000}),
            n_envs=args.sleep_envs,
            fragment_length=64,
            inference_batch_size=args.sleep_batch,
            timer_slack_ns=None if args.os_timer_slack else StepManagerConfig.timer_slack_ns,
        )
        fleet_sleep = fleet_steps_per_s(sleep, HoldingPolicy, {}, args.workers, args.seconds)
        ideal = n_sleep / (args.step_ms / 1000)
        measured_step = env_step_seconds(args.step_ms / 1000, sleep.timer_slack_ns)
        bcast = broadcast_seconds(args.broadcast_mb, 4, repeats=5)
    finally:
        ray.shutdown()
    rows = [
        ("CartPole-v1, plain 1-process gymnasium loop", f"{plain:,.0f} steps/s", "1 env, batch 1"),
        (
            f"CartPole-v1, fleet {args.workers}x{args.cartpole_envs} envs",
            f"{fleet_cart:,.0f} steps/s",
            f"{fleet_cart / plain:.2f}x the plain loop",
        ),
        (
            f"sleep {args.step_ms:g} ms/step, fleet {args.workers}x{args.sleep_envs} envs",
            f"{fleet_sleep:,.0f} steps/s",
            f"{100 * fleet_sleep / ideal:.0f}% of ideal {ideal:,.0f} steps/s",
        ),
        (
            f"  same, against the env's own {1000 * measured_step:.3f} ms/step in one process",
            f"{n_sleep / measured_step:,.0f} steps/s",
            f"{100 * fleet_sleep * measured_step / n_sleep:.0f}% of that",
        ),
        (
            f"broadcast {args.broadcast_mb} MB to 4 workers",
            f"median {np.median(bcast):.3f} s",
            f"max {max(bcast):.3f} s over {len(bcast)}",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>18}  {note}")
    print(
        json.dumps(
            {
                "cartpole_plain_steps_per_s": round(plain),
                "cartpole_fleet_steps_per_s": round(fleet_cart),
                "sleep_fleet_steps_per_s": round(fleet_sleep),
                "sleep_ideal_steps_per_s": round(ideal),
                "sleep_fraction_of_ideal": round(fleet_sleep / ideal, 3),
                "sleep_env_measured_step_ms": round(1000 * measured_step, 3),
                "broadcast_s_median": round(float(np.median(bcast)), 4),
            }
        )
    )


if __name__ == "__main__":
    main()
