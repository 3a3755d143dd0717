"""``rollhub demo arithmetic``: GRPO through the buffer server, with a Ray fleet of group rollout workers.

The object graph, built here:

- ``rollhub serve`` (sqlite, ``--max-staleness K``) as a child process on a free loopback port;
- a local Ray runtime with a :class:`~rollhub.rollout.fleet.RolloutFleet` of
  :class:`~rollhub.rollout.worker.RolloutWorker` actors, each coordinating a
  :class:`~rollhub.rollout.group_manager.GroupRolloutManager` (a tiny transformer policy on the curriculum's
  addition lesson) through :class:`~rollhub.rollout.group_loop.GroupRolloutLoop`, writing every batch to the
  server with :class:`~rollhub.rollout.http_writer.HttpWriter` (msgpack, ``policy_version`` = weight step);
- the :class:`~rollhub.train.grpo.GRPOTrainer` in this process, pulling leased batches through
  ``TrainerClient`` (:class:`~rollhub.train.grpo_server.ServerGRPOLoop`, which also refuses items older than
  ``K`` steps), acknowledging them, and publishing every step's weights to the fleet through the Ray object
  store (and every ``--checkpoint-every`` steps to a checkpoint directory);
- an evaluator: one more ``GroupRolloutManager`` in this process, loaded with the trainer's weights, decoding
  greedily over the held-out problems (never trained on) every ``--eval-every`` steps.

The default problem, ``a+b`` for ``a, b`` in ``0..49`` with 20% of the 2,500 pairs held out, is the widest
whose sums keep two digits; the held-out share measures whether the policy learned to add rather than the
table. Fewer operands generalize worse (``0..19``: held-out accuracy stalled near 0.79), a deeper model did not
help, and ``0..99`` (three-digit sums) learns far more slowly.

Outputs in ``--out-dir``: the learning-curve PNG, the server's sqlite file, checkpoints, per-worker tracker
lines (JSONL); on stdout, as the last line, a JSON summary with ``eval_accuracy``, ``steps`` and ``wall_s``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollhub.curriculum import CurriculumConfig, LessonConfig
from rollhub.inference.tokenizer import CharTokenizer
from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer, TransformerConfig
from rollhub.rollout.group_manager import GroupRolloutManager

MAX_LEN = 16  # "<bos>99+99=" and a three-digit answer with its end token fit


@dataclass(frozen=True, slots=True)
class FleetDemoConfig:
    """Settings of one distributed run (see ``--help`` for each)."""

    max_steps: int = 4000
    target: float = 0.9
    seed: int = 0
    n_prompts: int = 32
    group_size: int = 16
    lr: float = 1e-3
    entropy_coef: float = 0.06
    eval_every: int = 25
    max_wall_s: float = 900.0
    max_operand: int = 49
    d_model: int = 64
    n_layers: int = 2
    holdout_fraction: float = 0.2
    workers: int = 1
    max_staleness: int = 2
    worker_eval_every: int = 0
    checkpoint_every: int = 100
    out_dir: Path = Path("rollhub-demo-arithmetic")
    summary_json: Path | None = None
    progress: bool = True


def curriculum(cfg: FleetDemoConfig) -> CurriculumConfig:
    """One lesson, ``add``: ``a+b=`` for ``a, b`` in ``0..max_operand``, operands zero-padded, a seeded share
    of the pairs held out of training and used for evaluation only."""
    args = {
        "name": "add",
        "max_operand": cfg.max_operand,
        "holdout_fraction": cfg.holdout_fraction,
        "pad_operands": True,
        "width": len(str(2 * cfg.max_operand)),
    }
    lesson = LessonConfig("add", "arithmetic", args, (), cfg.n_prompts, cfg.group_size, cfg.target)
    return CurriculumConfig(lessons=(lesson,), eval_n_examples=10**6)  # eval draws every held-out problem


def model_shape(cfg: FleetDemoConfig) -> TransformerConfig:
    """The policy's shape (character vocabulary)."""
    return TransformerConfig(
        vocab_size=CharTokenizer().vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=4, max_len=MAX_LEN
    )


def build_policy(shape: TransformerConfig, seed: int) -> LocalPolicy:
    """A freshly initialised tiny transformer (its weights are replaced by the trainer's before any use)."""
    torch.manual_seed(seed)
    model = TinyTransformer(shape)
    model.eval()
    return LocalPolicy(model, CharTokenizer())


@dataclass(frozen=True)
class ArithmeticManagerFactory:
    """Picklable ``worker_id -> GroupRolloutManager``, run inside each Ray worker process."""

    curriculum: CurriculumConfig
    shape: TransformerConfig
    seed: int = 0

    def __call__(self, worker_id: str) -> GroupRolloutManager:
        torch.set_num_threads(1)  # small matrices; one thread per process keeps 2 cores from thrashing
        return GroupRolloutManager(self.curriculum, build_policy(self.shape, self.seed))


@dataclass
class Curves:
    """What the run records for the plot and the summary."""

    eval: list[tuple[int, float]] = field(default_factory=list)
    reward: list[tuple[int, float]] = field(default_factory=list)
    staleness: list[tuple[int, float]] = field(default_factory=list)


def evaluate(evaluator: GroupRolloutManager, trainer: Any, rng: np.random.Generator) -> float:
    """Greedy exact-answer accuracy of the trainer's current weights on every held-out problem."""
    evaluator.update_model({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    stats, _ = evaluator.evaluate_lesson(
        "add", 10**6, "micro_eval", rng, trainer.step_count, trainer.step_count, "eval"
    )
    return stats.accuracy


def run(cfg: FleetDemoConfig) -> dict[str, Any]:
    """Start the server, Ray (unless already initialised), the fleet and the trainer; train until the target,
    ``max_steps`` or ``max_wall_s``; stop everything it started; return the summary."""
    import ray

    from rollhub.client.trainer import TrainerClient
    from rollhub.demos.progress import Progress
    from rollhub.demos.serve import start_server
    from rollhub.rollout.fleet import FleetClient, FleetConfig
    from rollhub.rollout.group_loop import GroupLoopConfig, GroupLoopFactory
    from rollhub.rollout.http_writer import HttpWriter
    from rollhub.rollout.worker import RolloutWorkerConfig
    from rollhub.train.grpo import GRPOConfig, GRPOTrainer
    from rollhub.train.grpo_server import ServerGRPOLoop
    from rollhub.weights.checkpoint import CheckpointDirectory

    started = time.monotonic()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    db = cfg.out_dir / "rollhub.db"
    for stale_file in (db, db.with_name("rollhub.db-wal"), db.with_name("rollhub.db-shm")):
        stale_file.unlink(missing_ok=True)  # a fresh run must not resume a previous run's queue
    curr, shape = curriculum(cfg), model_shape(cfg)
    server = start_server(f"sqlite:///{db}", "--max-staleness", str(cfg.max_staleness))
    fleet: FleetClient | None = None
    owns_ray = not ray.is_initialized()  # a caller's runtime (a cluster, a test session) is used and left up
    if owns_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        client = TrainerClient(server.url)
        client.register(batch_size=cfg.n_prompts * cfg.group_size, max_token_len=MAX_LEN, num_steps=cfg.max_steps)
        writer = HttpWriter(server.url, "arithmetic", cfg.group_size, MAX_LEN)
        worker_cfg = RolloutWorkerConfig(
            max_staleness=cfg.max_staleness, queue_size=2, tracker=f"jsonl:{cfg.out_dir.resolve()}/{{worker_id}}.jsonl"
        )
        loops = GroupLoopFactory(
            ArithmeticManagerFactory(curr, shape, cfg.seed), GroupLoopConfig(eval_every=cfg.worker_eval_every)
        )
        fleet = FleetClient.start(
            FleetConfig(n_workers=cfg.workers, worker_num_cpus=2 / (cfg.workers + 1), worker=worker_cfg), loops, writer
        )
        checkpoints = CheckpointDirectory(cfg.out_dir / "checkpoints", keep_last=2)
        torch.manual_seed(cfg.seed)
        learner = build_policy(shape, cfg.seed).model
        gcfg = GRPOConfig(lr=cfg.lr, entropy_coef=cfg.entropy_coef, max_staleness=cfg.max_staleness)

        def publish(step: int, state: dict[str, torch.Tensor]) -> None:
            assert fleet is not None
            fleet.publish(step, {k: v.numpy() for k, v in state.items()})
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                checkpoints.save(step, state, {"task": "arithmetic"})

        trainer = GRPOTrainer(learner, gcfg, publish)
        publish(0, {k: v.detach().clone() for k, v in learner.state_dict().items()})
        loop = ServerGRPOLoop(trainer, client)
        evaluator = GroupRolloutManager(curr, build_policy(shape, cfg.seed))
        rng = np.random.default_rng(cfg.seed)
        curves = Curves(eval=[(0, evaluate(evaluator, trainer, rng))])
        bar = Progress(cfg.max_steps, "arithmetic") if cfg.progress else None
        while trainer.step_count < cfg.max_steps and time.monotonic() - started < cfg.max_wall_s:
            stats = loop.step()
            if stats is None:
                fleet.check()  # no batch within wait_s: make sure the fleet can still produce
                continue
            if "skipped" in stats:
                continue
            step = trainer.step_count
            curves.reward.append((step, stats["mean_score"]))
            curves.staleness.append((step, stats["mean_staleness"]))
            if step % cfg.eval_every == 0:
                curves.eval.append((step, evaluate(evaluator, trainer, rng)))
                if curves.eval[-1][1] >= cfg.target:
                    break
            if bar is not None:
                bar.update(
                    step,
                    step=step,
                    eval_acc=f"{curves.eval[-1][1]:.2f}",
                    reward=f"{stats['mean_score']:.2f}",
                    version=step,
                    staleness=f"{stats['mean_staleness']:.1f}",
                )
        if curves.eval[-1][0] != trainer.step_count:
            curves.eval.append((trainer.step_count, evaluate(evaluator, trainer, rng)))
        if bar is not None:
            bar.close()
        if trainer.step_count not in checkpoints.steps():
            checkpoints.save(trainer.step_count, trainer.model.state_dict(), {"task": "arithmetic", "final": True})
        fleet_status = fleet.status()
        status = client.status().raw
        evaluator.shutdown()
        client.close()
    finally:
        if fleet is not None:
            fleet.stop()
        if owns_ray:
            ray.shutdown()
        server.stop()
    wall_s = time.monotonic() - started
    plot(curves, cfg, cfg.out_dir / "learning_curve.png")
    counters = loop.counters
    rewards = [r for _, r in curves.reward]
    return {
        "eval_accuracy": curves.eval[-1][1],
        "initial_eval_accuracy": curves.eval[0][1],
        "eval_problems": f"{cfg.holdout_fraction:.0%} held-out of {(cfg.max_operand + 1) ** 2} problems",
        "steps": trainer.step_count,
        "wall_s": round(wall_s, 1),
        "target": cfg.target,
        "curve": [[s, round(a, 4)] for s, a in curves.eval],
        "train_reward_first10": round(float(np.mean(rewards[:10])), 4) if rewards else None,
        "train_reward_last10": round(float(np.mean(rewards[-10:])), 4) if rewards else None,
        "workers": cfg.workers,
        "max_staleness": cfg.max_staleness,
        "mean_item_staleness": round(float(np.mean(counters.staleness)), 3) if counters.staleness else 0.0,
        "max_item_staleness": max(counters.staleness, default=0),
        "trainer_stale_items": counters.stale_items,
        "server_stale_dropped": status.get("stale_dropped", status.get("stale")),
        "batches_skipped": counters.skipped,
        "worker_restarts": fleet_status["restarts"],
        "batches_written": sum(w.get("items_sent", 0) for w in fleet_status["workers"]),
        "out_dir": str(cfg.out_dir),
    }


def plot(curves: Curves, cfg: FleetDemoConfig, path: Path) -> None:
    """Held-out accuracy and mean training reward against trainer steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*curves.eval, strict=True), marker="o", label="held-out accuracy (greedy)")
    if curves.reward:
        ax.plot(*zip(*curves.reward, strict=True), alpha=0.5, label="mean training reward")
    ax.set_xlabel("trainer step (= policy version)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"GRPO over rollhub serve, {cfg.workers} Ray rollout worker(s): a+b, a,b<={cfg.max_operand}")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The distributed run's command-line flags."""
    d = FleetDemoConfig()
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="most trainer steps")
    p.add_argument("--target", type=float, default=d.target, help="stop at this held-out accuracy")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--n-prompts", type=int, default=d.n_prompts, help="prompts (groups) per batch")
    p.add_argument("--group-size", type=int, default=d.group_size, help="completions per prompt")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--entropy-coef", type=float, default=d.entropy_coef)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="trainer steps between evaluations")
    p.add_argument("--max-wall-s", type=float, default=d.max_wall_s, help="stop after this many seconds")
    p.add_argument("--max-operand", type=int, default=d.max_operand, help="operands range over 0..N")
    p.add_argument("--d-model", type=int, default=d.d_model, help="transformer width")
    p.add_argument("--n-layers", type=int, default=d.n_layers, help="transformer blocks")
    p.add_argument("--holdout-fraction", type=float, default=d.holdout_fraction, help="never train on this share")
    p.add_argument("--workers", type=int, default=d.workers, help="RolloutWorker actors")
    p.add_argument("--max-staleness", type=int, default=d.max_staleness, help="policy versions data may lag")
    p.add_argument("--worker-eval-every", type=int, default=d.worker_eval_every, help="worker-side eval (0: off)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints")
    p.add_argument("--out-dir", type=Path, default=d.out_dir, help="where the PNG, database and checkpoints go")
    p.add_argument("--summary-json", type=Path, default=None, help="also write the summary JSON here")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")


def main(argv: list[str] | None = None) -> int:
    """Run the distributed demo; print the JSON summary as the last line. 0 if the target was reached."""
    p = argparse.ArgumentParser(prog="rollhub demo arithmetic", description=__doc__.split("\n")[0])
    add_arguments(p)
    cfg = FleetDemoConfig(**vars(p.parse_args(argv)))
    torch.set_num_threads(1)
    summary = run(cfg)
    text = json.dumps(summary)
    if cfg.summary_json is not None:
        cfg.summary_json.parent.mkdir(parents=True, exist_ok=True)
        cfg.summary_json.write_text(text + "\n")
    print(text)
    return 0 if summary["eval_accuracy"] >= cfg.target else 1


if __name__ == "__main__":
    sys.exit(main())
