"""Rollout fleet throughput against the tools people would otherwise use, and the time to broadcast weights.

Run: ``python benchmarks/rollout.py`` (``--json`` ends with one JSON line). Every figure uses the same MLP policy
(the fleet's PPO actor-critic, 64x64, one forward pass per batch of observations) and is measured in rounds that
interleave the tools; the table shows medians over the rounds. A local Ray runtime (2 CPUs) runs only while the
Ray fleet is measured, in each round after the other figures: the loops and the local and process fleets run as
their users run them, with no idle Ray processes beside them.

* CartPole-v1 with 8 environments: the Ray fleet (environments stepped in the workers, and in 2 processes per
  worker), the local fleet (one worker thread of 8 environments, no Ray) and the process fleet (``--workers``
  worker processes, no Ray) against gymnasium ``SyncVectorEnv`` in one plain loop and EnvPool (when installed:
  ``pip install envpool``); with 64 and 256 environments against EnvPool.
* An environment that sleeps ``--step-ms`` per step, 8 instances: the Ray fleet, the process fleet and the local
  fleet stepping them in their workers with a step thread per environment (``--sleep-workers`` workers; one
  for the local fleet), the Ray and local fleets with an environment process per instance instead, and the
  process fleet with 8 workers that each step one instance with a step thread, against the ideal
  ``8 / step_s`` and against gymnasium ``AsyncVectorEnv``.
* Broadcasting ``--broadcast-mb`` of weights to 4 workers: from ``publish`` until every worker has loaded it.

Fleet figures count environment steps of fragments written into a replay buffer that a thread drains, after a
warm-up, so they include the whole path: stepping, inference, fragments, the sender thread and the buffer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gymnasium
import numpy as np
import ray
import torch

from rollhub.envs import EnvSpec
from rollhub.envs.builtin import SleepEnv
from rollhub.inference.base import PolicyStep
from rollhub.inference.mlp_policy import MLPStepPolicy
from rollhub.rollout.backends.base import FleetConfig
from rollhub.rollout.backends.local import LocalFleet, LocalWriter
from rollhub.rollout.backends.processes import ProcessFleet
from rollhub.rollout.backends.ray import ActorWriter, FleetClient, start_replay_buffer
from rollhub.rollout.replay import ReplayBuffer
from rollhub.rollout.step.env_worker import set_timer_slack
from rollhub.rollout.step.manager import StepManagerConfig, step_manager_factory
from rollhub.rollout.worker import RolloutWorkerConfig
from rollhub.train.ppo import PPOLearner

WEIGHTS = PPOLearner(4, 2).weights()
FLEET_POLICY = functools.partial(MLPStepPolicy, 4, 2, 64)  # the weights arrive with the fleet's first publish


def mlp_policy() -> MLPStepPolicy:
    """The fleet's CartPole policy (4 observations, 2 actions, 64x64) with fixed weights."""
    policy = MLPStepPolicy(4, 2, 64, seed=0)
    policy.load_weights(WEIGHTS)
    return policy


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


def vector_loop_steps_per_s(make: Callable[[], Any], n_envs: int, seconds: float) -> float:
    """Steps/s of a plain loop over a gymnasium-API vector env: one forward pass and one vector step per turn."""
    policy = mlp_policy()
    envs = make()
    try:
        obs, _ = envs.reset(seed=0)
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            actions = policy.act(np.asarray(obs, np.float32), None).actions
            obs, *_ = envs.step(actions)
            steps += n_envs
        return steps / (time.perf_counter() - start)
    finally:
        envs.close()


def sync_vector(n_envs: int) -> Callable[[], Any]:
    """gymnasium's ``SyncVectorEnv`` of ``n_envs`` CartPole-v1."""
    return lambda: gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * n_envs)


def async_sleep_vector(n_envs: int, step_s: float) -> Callable[[], Any]:
    """gymnasium's ``AsyncVectorEnv`` of ``n_envs`` sleeping environments (a process each)."""
    return functools.partial(gymnasium.vector.AsyncVectorEnv, [functools.partial(_SleepGymEnv, step_s)] * n_envs)


class _SleepGymEnv(gymnasium.Env):
    """:class:`SleepEnv` with gymnasium spaces, for ``AsyncVectorEnv``."""

    observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, step_s: float) -> None:
        set_timer_slack(StepManagerConfig.timer_slack_ns)  # as the fleet's environment processes run
        self.env = SleepEnv(step_s=step_s, episode_length=10**9)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        return self.env.reset(seed=seed)

    def step(self, action: Any) -> tuple:
        return self.env.step(action)


def envpool_vector(n_envs: int) -> Callable[[], Any] | None:
    """EnvPool's CartPole-v1 with ``n_envs`` environments, or ``None`` when EnvPool is not installed."""
    try:
        import envpool
    except ImportError:
        return None
    return lambda: envpool.make_gymnasium("CartPole-v1", num_envs=n_envs, seed=0)


def fleet_steps_per_s(
    manager: StepManagerConfig, policy_factory: Any, n_workers: int, seconds: float, backend: str = "ray"
) -> float:
    """Environment steps/s of a fleet writing into a replay buffer that a thread drains, after a warm-up
    (``backend``: ``"ray"``, worker actors and a buffer actor; ``"local"``, worker threads and a buffer here;
    ``"processes"``, worker processes and a buffer here)."""
    config = FleetConfig(n_workers=n_workers, worker_num_cpus=2.0 / n_workers, worker=RolloutWorkerConfig(10**9))
    factory = step_manager_factory(manager, policy_factory)
    if backend in ("local", "processes"):
        local = ReplayBuffer(batch_size=4, max_staleness=10**9, max_queued=10_000, in_process=True)
        kind = LocalFleet if backend == "local" else ProcessFleet
        fleet: Any = kind(config, factory, LocalWriter(local))
        take, close = functools.partial(local.next_batch, 0.2), lambda: None
    else:
        replay = start_replay_buffer(batch_size=4, max_staleness=10**9, max_queued=10_000)
        fleet = FleetClient.start(config, factory, ActorWriter(replay))
        take, close = lambda: ray.get(replay.next_batch.remote(0.2)), lambda: ray.kill(replay)
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            take()

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    try:
        fleet.publish(0, WEIGHTS)

        def total_steps() -> float:
            return sum(w["pipeline"]["env_steps"] for w in fleet.status()["workers"])

        deadline = time.monotonic() + 60
        warm = 20 * manager.n_envs * n_workers
        while total_steps() < warm and time.monotonic() < deadline:  # every environment up and stepping
            time.sleep(0.2)
        s0, t0 = total_steps(), time.perf_counter()
        time.sleep(seconds)
        s1, t1 = total_steps(), time.perf_counter()
        return (s1 - s0) / (t1 - t0)
    finally:
        stop.set()
        drainer.join()
        fleet.stop()
        close()


def env_step_seconds(step_s: float, n: int = 500) -> float:
    """The sleeping environment's own mean step time in this process, with the timer slack the fleet's
    environment processes use (the OS overshoots short sleeps)."""
    env = SleepEnv(step_s=step_s, episode_length=10**9)
    env.reset(seed=0)
    result: list[float] = []

    def run() -> None:  # timer slack is per thread: measure in a fresh one
        set_timer_slack(StepManagerConfig.timer_slack_ns)
        start = time.perf_counter()
        for _ in range(n):
            env.step(0)
        result.append((time.perf_counter() - start) / n)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


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


def cartpole_fleet(n_envs: int, workers: int, processes: int | None, fragment_length: int) -> StepManagerConfig:
    """The manager of each of ``workers`` workers for ``n_envs`` CartPole environments in all."""
    return StepManagerConfig(EnvSpec("CartPole-v1"), n_envs=n_envs // workers, env_processes=processes,
                             fragment_length=fragment_length)  # fmt: skip


def measure_round(args: argparse.Namespace) -> dict[str, float]:
    """One round of every throughput figure, interleaved tool by tool: first those that need no Ray, then, with a
    Ray runtime started for them, the Ray fleet's (an idle Ray runtime takes CPU the others would not pay)."""
    out = measure_without_ray(args)
    with ray_runtime():
        out |= measure_on_ray(args)
    return out


@contextlib.contextmanager
def ray_runtime() -> Iterator[None]:
    """A local Ray runtime with 2 CPUs for the duration of the block."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=1024 * 2**20, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def sleep_fleets(args: argparse.Namespace) -> tuple[StepManagerConfig, StepManagerConfig]:
    """Each of ``--sleep-workers`` workers' manager for the sleeping environment: a step thread per environment,
    and an environment process per environment."""
    sw = args.sleep_workers
    threads = StepManagerConfig(EnvSpec("sleep", {"step_s": args.step_ms / 1000}), n_envs=8 // sw, env_processes=0,
                                step_threads=8 // sw, fragment_length=args.fragment_length)  # fmt: skip
    return threads, dataclasses.replace(threads, env_processes=8 // sw, step_threads=0)


def measure_without_ray(args: argparse.Namespace) -> dict[str, float]:
    """The loops, EnvPool, and the local and process fleets."""
    out: dict[str, float] = {}
    s, w = args.seconds, args.workers
    out["sync_8"] = vector_loop_steps_per_s(sync_vector(8), 8, s)
    out["local_8"] = fleet_steps_per_s(cartpole_fleet(8, 1, 0, args.fragment_length), FLEET_POLICY, 1, s, "local")
    out["procs_8"] = fleet_steps_per_s(cartpole_fleet(8, w, 0, args.fragment_length), FLEET_POLICY, w, s, "processes")
    for n in (8, 64, 256):
        pool = envpool_vector(n)
        if pool is not None:
            out[f"envpool_{n}"] = vector_loop_steps_per_s(pool, n, s)
        if n != 8:
            local = cartpole_fleet(n, 1, 0, args.fragment_length)
            out[f"local_{n}"] = fleet_steps_per_s(local, FLEET_POLICY, 1, s, "local")
            procs = cartpole_fleet(n, w, 0, args.fragment_length)
            out[f"procs_{n}"] = fleet_steps_per_s(procs, FLEET_POLICY, w, s, "processes")
    threads, _ = sleep_fleets(args)
    out["sleep_procs"] = fleet_steps_per_s(threads, FLEET_POLICY, args.sleep_workers, s, "processes")
    one_each = dataclasses.replace(threads, n_envs=1, step_threads=1)  # 8 workers, each with its one environment
    out["sleep_procs_8_workers"] = fleet_steps_per_s(one_each, FLEET_POLICY, 8, s, "processes")
    local = dataclasses.replace(threads, n_envs=8, step_threads=8)
    out["sleep_local"] = fleet_steps_per_s(local, FLEET_POLICY, 1, s, "local")
    local_processes = dataclasses.replace(local, env_processes=8, step_threads=0)
    out["sleep_local_env_processes"] = fleet_steps_per_s(local_processes, FLEET_POLICY, 1, s, "local")
    out["sleep_async"] = vector_loop_steps_per_s(async_sleep_vector(8, args.step_ms / 1000), 8, s)
    return out


def measure_on_ray(args: argparse.Namespace) -> dict[str, float]:
    """The Ray fleet's figures (a Ray runtime is up)."""
    out: dict[str, float] = {}
    s, w = args.seconds, args.workers
    out["fleet_8"] = fleet_steps_per_s(cartpole_fleet(8, w, 0, args.fragment_length), FLEET_POLICY, w, s)
    procs = cartpole_fleet(8, w, args.processes, args.fragment_length)
    out["fleet_8_processes"] = fleet_steps_per_s(procs, FLEET_POLICY, w, s)
    for n in (64, 256):
        out[f"fleet_{n}"] = fleet_steps_per_s(cartpole_fleet(n, w, 0, args.fragment_length), FLEET_POLICY, w, s)
    threads, processes = sleep_fleets(args)
    out["sleep_fleet"] = fleet_steps_per_s(threads, FLEET_POLICY, args.sleep_workers, s)
    out["sleep_fleet_env_processes"] = fleet_steps_per_s(processes, FLEET_POLICY, args.sleep_workers, s)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0, help="measurement window per figure")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows medians")
    p.add_argument("--workers", type=int, default=2, help="fleet workers (the environments are split among them)")
    p.add_argument("--processes", type=int, default=2, help="environment processes per worker, processes figure")
    p.add_argument("--fragment-length", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--sleep-workers", type=int, default=1, help="Ray and process fleet workers on the sleeping env")
    p.add_argument("--broadcast-mb", type=int, default=100)
    p.add_argument("--json", action="store_true", help="end with one line of JSON")
    p.add_argument(
        "--cartpole-8-only",
        action="store_true",
        help="only SyncVectorEnv and the process fleet on 8 CartPoles, interleaved (more rounds, sooner)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.cartpole_8_only:
        cartpole_8_pair(args)
        return
    rounds = []
    for r in range(args.rounds):
        rounds.append(measure_round(args))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:,.0f}" for k, v in rounds[-1].items()), flush=True)
    with ray_runtime():
        bcast = broadcast_seconds(args.broadcast_mb, 4, repeats=5)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    step_s = args.step_ms / 1000
    ideal = 8 / step_s
    measured_step = env_step_seconds(step_s)
    report(args, med, ideal, measured_step, bcast)
    if args.json:
        print(json.dumps(figures(med, ideal, measured_step, bcast)))


def cartpole_8_pair(args: argparse.Namespace) -> None:
    """The process fleet against ``SyncVectorEnv`` on 8 CartPoles alone, round by round: the ratio of the 1.0x
    goal measured with more rounds than the whole table affords."""
    ratios, sync, procs = [], [], []
    fleet = cartpole_fleet(8, args.workers, 0, args.fragment_length)
    for r in range(args.rounds):
        sync.append(vector_loop_steps_per_s(sync_vector(8), 8, args.seconds))
        procs.append(fleet_steps_per_s(fleet, FLEET_POLICY, args.workers, args.seconds, "processes"))
        ratios.append(procs[-1] / sync[-1])
        print(f"round {r + 1}: SyncVectorEnv {sync[-1]:,.0f}, process fleet {procs[-1]:,.0f}: {ratios[-1]:.3f}x",
              flush=True)  # fmt: skip
    out = {"cartpole_sync_vector_steps_per_s": round(statistics.median(sync)),
           "cartpole_process_fleet_steps_per_s": round(statistics.median(procs)),
           "cartpole_process_fleet_vs_sync_vector_median_ratio": round(statistics.median(ratios), 3),
           "cartpole_process_fleet_vs_sync_vector_min_ratio": round(min(ratios), 3),
           "cartpole_process_fleet_vs_sync_vector_max_ratio": round(max(ratios), 3)}  # fmt: skip
    print(f"median ratio {out['cartpole_process_fleet_vs_sync_vector_median_ratio']:.3f}x "
          f"({min(ratios):.3f}x-{max(ratios):.3f}x over {len(ratios)} rounds)")  # fmt: skip
    if args.json:
        print(json.dumps(out))


def report(args: argparse.Namespace, med: dict[str, float], ideal: float, step: float, bcast: list[float]) -> None:
    """Print the table of medians."""
    layout = f"{args.workers} workers x {8 // args.workers} envs"
    sync = med["sync_8"]
    rows = [
        ("CartPole-v1, 8 envs, gymnasium SyncVectorEnv loop", sync, "reference"),
        (f"CartPole-v1, 8 envs, rollhub fleet ({layout}, in the workers)", med["fleet_8"],
         f"{med['fleet_8'] / sync:.2f}x SyncVectorEnv"),
        (f"CartPole-v1, 8 envs, rollhub fleet ({layout}, {args.processes} env processes each)",
         med["fleet_8_processes"], f"{med['fleet_8_processes'] / sync:.2f}x SyncVectorEnv"),
        ("CartPole-v1, 8 envs, rollhub local fleet (1 worker thread, no Ray)", med["local_8"],
         f"{med['local_8'] / sync:.2f}x SyncVectorEnv"),
        (f"CartPole-v1, 8 envs, rollhub process fleet ({layout}, no Ray)", med["procs_8"],
         f"{med['procs_8'] / sync:.2f}x SyncVectorEnv"),
    ]  # fmt: skip
    for n in (8, 64, 256):
        pool = med.get(f"envpool_{n}")
        if pool is not None:
            note = f"rollhub fleet {med[f'fleet_{n}'] / pool:.2f}x"
            rows.append((f"CartPole-v1, {n} envs, EnvPool loop", pool, note))
        if n != 8:
            rows.append((f"CartPole-v1, {n} envs, rollhub fleet ({args.workers} workers)", med[f"fleet_{n}"], ""))
            rows.append((f"CartPole-v1, {n} envs, rollhub local fleet (1 worker)", med[f"local_{n}"], ""))
            note = f"{med[f'procs_{n}'] / pool:.2f}x EnvPool" if pool is not None else ""
            rows.append((f"CartPole-v1, {n} envs, rollhub process fleet ({args.workers} workers)",
                         med[f"procs_{n}"], note))  # fmt: skip
    sleep = f"sleep {args.step_ms:g} ms/step, 8 envs"
    own = f"{args.sleep_workers} worker(s), a step thread per env"

    def share(key: str) -> str:
        return f"{100 * med[key] / ideal:.1f}% of ideal {ideal:,.0f}; {med[key] / med['sleep_async']:.2f}x Async"

    rows += [
        (f"{sleep}, rollhub fleet ({own})", med["sleep_fleet"],
         f"{share('sleep_fleet')}; {100 * med['sleep_fleet'] * step / 8:.0f}% of the env's own {1000 * step:.3f} ms"),
        (f"{sleep}, rollhub process fleet ({own})", med["sleep_procs"], share("sleep_procs")),
        (f"{sleep}, rollhub local fleet (1 worker thread, a step thread per env)", med["sleep_local"],
         share("sleep_local")),
        (f"{sleep}, rollhub process fleet (8 workers, 1 env each, step thread)", med["sleep_procs_8_workers"],
         share("sleep_procs_8_workers")),
        (f"{sleep}, rollhub fleet ({args.sleep_workers} worker(s), an env process each)",
         med["sleep_fleet_env_processes"], share("sleep_fleet_env_processes")),
        (f"{sleep}, rollhub local fleet (1 worker thread, an env process each)", med["sleep_local_env_processes"],
         share("sleep_local_env_processes")),
        (f"{sleep}, gymnasium AsyncVectorEnv", med["sleep_async"], f"{100 * med['sleep_async'] / ideal:.1f}% of ideal"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10,.0f} steps/s  {note}")
    print(f"{'broadcast ' + str(args.broadcast_mb) + ' MB to 4 workers':<{width}}  median {np.median(bcast):.3f} s, "
          f"max {max(bcast):.3f} s over {len(bcast)}")  # fmt: skip


def figures(med: dict[str, float], ideal: float, step: float, bcast: list[float]) -> dict[str, Any]:
    """The JSON line's figures."""
    out: dict[str, Any] = {
        "cartpole_fleet_steps_per_s": round(med["fleet_8"]),
        "cartpole_sync_vector_steps_per_s": round(med["sync_8"]),
        "cartpole_fleet_vs_sync_vector": round(med["fleet_8"] / med["sync_8"], 3),
        "cartpole_fleet_processes_steps_per_s": round(med["fleet_8_processes"]),
        "cartpole_local_fleet_steps_per_s": round(med["local_8"]),
        "cartpole_local_fleet_vs_sync_vector": round(med["local_8"] / med["sync_8"], 3),
        "cartpole_process_fleet_steps_per_s": round(med["procs_8"]),
        "cartpole_process_fleet_vs_sync_vector": round(med["procs_8"] / med["sync_8"], 3),
        "sleep_fleet_steps_per_s": round(med["sleep_fleet"]),
        "sleep_ideal_steps_per_s": round(ideal),
        "sleep_fraction_of_ideal": round(med["sleep_fleet"] / ideal, 3),
        "sleep_fleet_env_processes_fraction_of_ideal": round(med["sleep_fleet_env_processes"] / ideal, 3),
        "sleep_process_fleet_steps_per_s": round(med["sleep_procs"]),
        "sleep_process_fleet_fraction_of_ideal": round(med["sleep_procs"] / ideal, 3),
        "sleep_process_fleet_8_workers_fraction_of_ideal": round(med["sleep_procs_8_workers"] / ideal, 3),
        "sleep_local_fleet_steps_per_s": round(med["sleep_local"]),
        "sleep_local_fleet_fraction_of_ideal": round(med["sleep_local"] / ideal, 3),
        "sleep_local_fleet_env_processes_fraction_of_ideal": round(med["sleep_local_env_processes"] / ideal, 3),
        "sleep_async_vector_steps_per_s": round(med["sleep_async"]),
        "sleep_env_measured_step_ms": round(1000 * step, 3),
        "broadcast_s_median": round(float(np.median(bcast)), 4),
    }
    for n in (8, 64, 256):
        if f"envpool_{n}" in med:
            out[f"cartpole_envpool_{n}_steps_per_s"] = round(med[f"envpool_{n}"])
        if n != 8:
            out[f"cartpole_fleet_{n}_steps_per_s"] = round(med[f"fleet_{n}"])
            out[f"cartpole_local_fleet_{n}_steps_per_s"] = round(med[f"local_{n}"])
            out[f"cartpole_process_fleet_{n}_steps_per_s"] = round(med[f"procs_{n}"])
    return out


if __name__ == "__main__":
    main()
