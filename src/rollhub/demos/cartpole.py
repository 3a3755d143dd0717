"""``rollhub demo cartpole``: PPO on CartPole-v1 with a local Ray rollout fleet, to a mean return >= 475.

The object graph, built here: a replay-buffer actor (the ExperienceBuffer core, per-fragment staleness),
a RolloutFleet of RolloutWorker actors (each a StepRolloutManager over EnvWorker processes), and the PPO
learner in this process, which consumes one batch per update and publishes the next weight version.
Prints a live progress line, writes a learning-curve PNG and ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rollhub.envs.step import EnvSpec


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The demo's command line."""
    p = argparse.ArgumentParser(prog="rollhub demo cartpole", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="RolloutWorker actors")
    p.add_argument("--envs-per-worker", type=int, default=4, help="EnvWorker processes per worker")
    p.add_argument("--fragment-length", type=int, default=64, help="steps per SampleFragment")
    p.add_argument("--batch-fragments", type=int, default=8, help="fragments per PPO update")
    p.add_argument("--max-staleness", type=int, default=1, help="policy versions a step may lag the trainer")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--target-return", type=float, default=475.0, help="stop at this mean over 20 episodes")
    p.add_argument("--window", type=int, default=20, help="episodes in the running mean")
    p.add_argument("--max-seconds", type=float, default=600.0, help="give up after this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("rollhub-runs/cartpole"), help="where the PNG goes")
    p.add_argument("--summary-json", type=Path, default=None, help="also write the summary JSON here")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    return p.parse_args(argv)


def progress_fields(steps: int, mean_ret: float, best: float, version: int, stale: int) -> dict[str, object]:
    """The fields of the live progress line."""
    return {"return": f"{mean_ret:.0f} (best {best:.0f})", "steps": steps, "version": version, "stale": stale}


def plot_curve(history: list[Any], window: int, path: Path) -> None:
    """Episode return against environment steps, with the running mean over ``window`` episodes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    returns = np.array([e.ret for e in history], dtype=float)
    steps = np.cumsum([e.length for e in history])
    mean = np.array([returns[max(0, i - window + 1) : i + 1].mean() for i in range(len(returns))])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, returns, ".", alpha=0.3, label="episode return")
    ax.plot(steps, mean, "-", label=f"mean of last {window}")
    ax.axhline(475, color="gray", linestyle="--", linewidth=1, label="475")
    ax.set_xlabel("environment steps (finished episodes)")
    ax.set_ylabel("return")
    ax.set_title("PPO on CartPole-v1, Ray rollout fleet")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


@dataclass
class TrainResult:
    """What the training loop reached."""

    version: int = 0
    trained_steps: int = 0
    max_staleness_seen: int = 0
    best_mean_return: float = 0.0
    reached: bool = False
    stopped_by: str | None = None


def start_fleet(args: argparse.Namespace, replay: Any) -> Any:
    """A fleet of ``--workers`` RolloutWorkers, each a StepRolloutManager over CartPole EnvWorkers."""
    from rollhub.rollout.fleet import FleetClient, FleetConfig
    from rollhub.rollout.step_manager import StepManagerConfig, step_manager_factory
    from rollhub.rollout.worker import RolloutWorkerConfig
    from rollhub.rollout.writers import ActorWriter
    from rollhub.train.ppo import make_cartpole_policy

    manager_config = StepManagerConfig(
        env=EnvSpec("CartPole-v1"), n_envs=args.envs_per_worker, fragment_length=args.fragment_length, seed=args.seed
    )
    fleet_config = FleetConfig(
        n_workers=args.workers,
        worker_num_cpus=1.0 / args.workers,
        worker=RolloutWorkerConfig(max_staleness=args.max_staleness),
    )
    policy_factory = functools.partial(make_cartpole_policy, 64)
    return FleetClient.start(fleet_config, step_manager_factory(manager_config, policy_factory), ActorWriter(replay))


def train(args: argparse.Namespace, replay: Any, fleet: Any, learner: Any, started: float, stop: Any) -> TrainResult:
    """One PPO update per served batch, publishing version ``step + 1``, until the target, the time limit or
    a stop signal."""
    import ray

    from rollhub.demos.progress import Progress, share

    result = TrainResult()
    stats = fleet.statistics()
    fleet.publish(0, learner.weights())
    bar = None if args.no_progress else Progress("cartpole")
    mean_ret, staleness = 0.0, 0
    while time.perf_counter() - started < args.max_seconds and not stop.requested:
        batch = ray.get(replay.next_batch.remote(2.0))
        if batch is None:
            fleet.check()  # a dead fleet is an error here, not an endless wait
            continue
        staleness = batch.step - min(f.min_version for f in batch.items)
        result.max_staleness_seen = max(result.max_staleness_seen, staleness)
        learner.update(batch.items)
        result.version = batch.step + 1
        fleet.publish(result.version, learner.weights())
        result.trained_steps += sum(f.length for f in batch.items)
        recent = ray.get(stats.recent_returns.remote(args.window))
        mean_ret = float(np.mean(recent)) if recent else 0.0
        if len(recent) >= args.window:
            result.best_mean_return = max(result.best_mean_return, mean_ret)
            result.reached = mean_ret >= args.target_return
        if bar is not None:
            fraction = max(
                share(result.best_mean_return, args.target_return),
                share(time.perf_counter() - started, args.max_seconds),
            )
            fields = progress_fields(result.trained_steps, mean_ret, result.best_mean_return, result.version, staleness)
            bar.update(fraction, **fields)
        if result.reached:
            break
    result.stopped_by = stop.signal_name
    if bar is not None:
        state = (
            "target reached"
            if result.reached
            else (f"stopped by {stop.signal_name}" if stop.requested else "time limit")
        )
        fields = progress_fields(result.trained_steps, mean_ret, result.best_mean_return, result.version, staleness)
        bar.close(state, result.reached, share(time.perf_counter() - started, args.max_seconds), **fields)
    return result


def summarize(args: argparse.Namespace, fleet: Any, result: TrainResult, wall: float) -> dict[str, Any]:
    """Draw the learning curve and gather the summary the demo prints as its last line."""
    import ray

    from rollhub.rollout.stats import STAGES

    history = ray.get(fleet.statistics().history.remote())
    status = fleet.status()
    png = args.out_dir / "cartpole_learning_curve.png"
    plot_curve(history, args.window, png)
    return {
        "mean_return_last20": round(float(np.mean([e.ret for e in history[-20:]])) if history else 0.0, 2),
        "env_steps": int(status["pipeline"].get("env_steps", 0)),
        "trained_steps": result.trained_steps,
        "wall_s": round(wall, 1),
        "max_staleness_seen": result.max_staleness_seen,
        "policy_version": result.version,
        "episodes": len(history),
        "worker_restarts": sum(status["restarts"]),
        "stopped_by": result.stopped_by,
        "pipeline_s": {stage: round(status["pipeline"].get(f"{stage}_s", 0.0), 2) for stage in STAGES},
        "curve_png": os.fspath(png),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return 0 when the target mean return was reached, 1 when the time ran out first, and
    ``128 + N`` when signal N stopped it (the summary and the PNG are written in every case)."""
    args = parse_args(argv)
    from rollhub.demos.progress import say
    from rollhub.demos.stopping import StopSignals

    note = (lambda _msg: None) if args.no_progress else say
    with StopSignals() as stop:
        note("cartpole: loading Ray and torch...")
        import ray
        import torch

        from rollhub.rollout.replay import start_replay_buffer
        from rollhub.train.ppo import PPOConfig, PPOLearner

        torch.set_num_threads(1)
        started = time.perf_counter()
        own_ray = not ray.is_initialized()
        if own_ray:
            note("cartpole: starting Ray (2 CPUs)...")
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                object_store_memory=256 * 2**20,
                log_to_driver=False,
                configure_logging=False,
            )
            stop.install()  # again: the Ray runtime replaced the handlers with its own (a stack dump on SIGTERM)
        fleet = None
        try:
            note(f"cartpole: starting {args.workers} rollout workers x {args.envs_per_worker} CartPole envs...")
            replay = start_replay_buffer(args.batch_fragments, args.max_staleness, max_queued=16 * args.batch_fragments)
            fleet = start_fleet(args, replay)
            learner = PPOLearner(4, 2, PPOConfig(lr=args.lr, seed=args.seed))
            result = train(args, replay, fleet, learner, started, stop)
            summary = summarize(args, fleet, result, time.perf_counter() - started)
        finally:
            if fleet is not None:
                fleet.stop()
            if own_ray:
                ray.shutdown()
        if args.summary_json is not None:
            args.summary_json.parent.mkdir(parents=True, exist_ok=True)
            args.summary_json.write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary), flush=True)
        if stop.requested:
            return stop.exit_code
        return 0 if summary["mean_return_last20"] >= args.target_return else 1


if __name__ == "__main__":
    raise SystemExit(main())
