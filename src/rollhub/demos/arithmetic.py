"""``rollhub demo arithmetic``: a tiny transformer learns addition by GRPO from scratch on a CPU.

The run wires the group stack in one process, each part in the role it has in a distributed run:

- a :class:`~rollhub.rollout.group_manager.GroupRolloutManager` samples groups of the curriculum's lesson
  with a :class:`~rollhub.inference.torch_policy.LocalPolicy`;
- the loop plays the rollout worker: it syncs weights into the manager, stamps ``weight_step`` and writes each
  batch as scored-data items (the buffer server's format) to an :class:`ItemQueue`;
- :class:`~rollhub.train.grpo.GRPOTrainer` pulls items from that queue exactly as it would pull ``GET /batch``
  answers through ``TrainerClient``, and publishes weights to the policy and to a checkpoint directory.

Evaluation decodes greedily over every one of the 100 problems; the policy starts at chance (0%, its answers
are random tokens). With ``--holdout-fraction`` a seeded share of the problems is never trained on and
evaluation covers only those, which measures generalization to unseen pairs instead. ``--digits 2`` switches
to two-digit operands (10,000 problems, 5% held out by default): too many to memorize, so held-out accuracy
shows whether the policy has learned to add.

Outputs: a learning-curve PNG, the evaluation rollouts (JSONL), the last checkpoints, and, as the last line of
stdout (and in ``--summary-json``), a JSON summary with ``eval_accuracy``, ``steps`` and ``wall_s``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollhub.curriculum import CurriculumConfig, LessonConfig
from rollhub.inference.tokenizer import CharTokenizer
from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer, TransformerConfig
from rollhub.rollout.group_manager import GroupRolloutManager
from rollhub.rollout.group_writers import FileRolloutWriter
from rollhub.train.grpo import GRPOConfig, GRPOTrainer
from rollhub.weights.checkpoint import CheckpointDirectory

WORKER_ID = "local-0"


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Settings of one demo run (see ``--help`` for each)."""

    max_steps: int = 1500
    target: float = 0.95
    seed: int = 0
    n_prompts: int = 32
    group_size: int = 16
    lr: float = 1e-3
    entropy_coef: float = 0.06
    eval_every: int = 25
    max_wall_s: float = 900.0
    holdout_fraction: float | None = None
    digits: int = 1
    out_dir: Path = Path("rollhub-demo-arithmetic")
    summary_json: Path | None = None
    progress: bool = True


class ItemQueue:
    """An in-process stand-in for the buffer server: producers ``put`` items, the trainer takes batches.

    ``next_batch`` returns whole groups (items) totalling at least ``batch_size`` sequences, oldest first, or
    None when fewer are queued, which is the contract of ``GET /batch``.
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self._items: deque[dict[str, Any]] = deque()
        self._queued = 0

    def put(self, items: list[dict[str, Any]]) -> None:
        """Queue items (one group each), as ``POST /scored_data_list`` would."""
        self._items.extend(items)
        self._queued += sum(len(it["tokens"]) for it in items)

    def next_batch(self) -> list[dict[str, Any]] | None:
        """The oldest whole items reaching ``batch_size`` sequences, or None (see the class docstring)."""
        if self._queued < self.batch_size:
            return None
        out, n = [], 0
        while n < self.batch_size:
            item = self._items.popleft()
            out.append(item)
            n += len(item["tokens"])
        self._queued -= n
        return out


@dataclass(frozen=True, slots=True)
class Task:
    """The arithmetic environment's arguments and how evaluation is described."""

    env_args: dict[str, Any]
    eval_n_examples: int
    eval_label: str


def task(cfg: DemoConfig) -> Task:
    """One-digit operands (100 problems, all evaluated unless some are held out) or two-digit operands."""
    max_operand = 10**cfg.digits - 1
    holdout = cfg.holdout_fraction if cfg.holdout_fraction is not None else (0.0 if cfg.digits == 1 else 0.05)
    args = {"name": "add", "max_operand": max_operand, "holdout_fraction": holdout}
    if cfg.digits > 1:
        args.update(width=cfg.digits + 1, pad_operands=True)
    n_problems = (max_operand + 1) ** 2
    n_eval = min(200, round(holdout * n_problems)) if holdout else n_problems
    label = f"{n_eval} held-out problems" if holdout else f"all {n_problems} problems"
    return Task(args, n_eval, label)


def curriculum(cfg: DemoConfig) -> CurriculumConfig:
    """One lesson, ``add``: all problems of the task (see :func:`task`), graduating at the target accuracy.

    Staged variants (small operands first, or sums without a carry first) learned more slowly when tried: a
    policy that has settled on the easy lesson's answers has to unlearn them, so the demo trains on the whole
    table from the start and lets group-relative advantages find the signal.
    """
    t = task(cfg)
    lesson = LessonConfig("add", "arithmetic", t.env_args, (), cfg.n_prompts, cfg.group_size, cfg.target)
    return CurriculumConfig(lessons=(lesson,), eval_n_examples=t.eval_n_examples)


@dataclass(slots=True)
class Run:
    """The mutable state of a run, kept together so the loop reads top to bottom."""

    manager: GroupRolloutManager
    trainer: GRPOTrainer
    queue: ItemQueue
    checkpoints: CheckpointDirectory
    eval_writer: FileRolloutWriter
    rng: np.random.Generator
    pending_weights: dict[str, torch.Tensor] | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)
    rewards: list[tuple[int, float]] = field(default_factory=list)


def build(cfg: DemoConfig) -> Run:
    """Construct the object graph: policy, manager, trainer, queue, checkpoints, writer."""
    torch.manual_seed(cfg.seed)
    tok = CharTokenizer()
    shape = TransformerConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4, max_len=16)
    learner, actor = TinyTransformer(shape), TinyTransformer(shape)
    actor.load_state_dict(learner.state_dict())
    actor.eval()
    manager = GroupRolloutManager(curriculum(cfg), LocalPolicy(actor, tok))
    checkpoints = CheckpointDirectory(cfg.out_dir / "checkpoints", keep_last=2)
    run = Run(
        manager=manager,
        trainer=GRPOTrainer(learner, GRPOConfig(lr=cfg.lr, entropy_coef=cfg.entropy_coef, max_staleness=2)),
        queue=ItemQueue(batch_size=cfg.n_prompts * cfg.group_size),
        checkpoints=checkpoints,
        eval_writer=FileRolloutWriter(cfg.out_dir / "eval_rollouts.jsonl"),
        rng=np.random.default_rng(cfg.seed),
    )

    def publish(step: int, state: dict[str, torch.Tensor]) -> None:
        run.pending_weights = state  # picked up by the producer's next weight sync
        if step % 100 == 0:
            checkpoints.save(step, state, {"task": "arithmetic"})

    run.trainer.publish = publish
    return run


def produce(run: Run, step: int) -> dict[str, float]:
    """The rollout worker's turn: sync weights, sample a lesson's batch, report it, queue its items."""
    if run.pending_weights is not None:
        run.manager.update_model(run.pending_weights)
        run.pending_weights = None
    weight_step = run.trainer.step_count
    lesson_id = run.manager.sample_lesson(int(run.rng.integers(2**31)))
    lesson = run.manager.lesson(lesson_id)
    batch, metrics = run.manager.sample_batch(
        lesson_id, lesson.n_examples, lesson.n_generations, "train", run.rng, weight_step, WORKER_ID
    )
    if batch is None:
        return {}
    run.manager.update_training_stats(lesson_id, batch, step)
    run.queue.put(batch.to_items())
    return metrics or {}


def evaluate(run: Run, step: int) -> float:
    """Greedy accuracy on the evaluation problems; updates the curriculum (graduation), logs the rollouts."""
    n = run.manager.curriculum_config.eval_n_examples
    results = run.manager.evaluate_curriculum(n, run.rng, step, run.trainer.step_count, WORKER_ID)
    for _, batch in results.values():
        run.eval_writer.write_batch(batch)
    stats, _ = results["add"]
    run.curve.append((step, stats.accuracy))
    return stats.accuracy


def train(run: Run, cfg: DemoConfig) -> int:
    """Alternate producing and training until the target accuracy, ``max_steps`` or ``max_wall_s``."""
    start = time.monotonic()
    evaluate(run, 0)
    step = 0
    while step < cfg.max_steps and time.monotonic() - start < cfg.max_wall_s:
        metrics = produce(run, step)
        items = run.queue.next_batch()
        if items is None:
            continue
        stats = run.trainer.step(items)
        step = run.trainer.step_count
        run.rewards.append((step, stats["mean_score"]))
        if step % cfg.eval_every == 0:
            accuracy = evaluate(run, step)
            if cfg.progress:
                _progress(step, cfg.max_steps, accuracy, metrics, time.monotonic() - start)
            if accuracy >= cfg.target:
                break
    if not run.curve or run.curve[-1][0] != step:
        evaluate(run, step)
    if cfg.progress:
        sys.stderr.write("\n")
    return step


def _progress(step: int, total: int, accuracy: float, metrics: dict[str, float], elapsed: float) -> None:
    width = 30
    filled = int(width * min(step / total, 1.0))
    bar = "#" * filled + "-" * (width - filled)
    sys.stderr.write(
        f"\r[{bar}] step {step}/{total} eval_acc {accuracy:.2f} "
        f"train_acc {metrics.get('accuracy', 0.0):.2f} {elapsed:.0f}s"
    )
    sys.stderr.flush()


def plot(run: Run, path: Path, eval_label: str, digits: int) -> None:
    """Held-out evaluation accuracy and training reward against trainer steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*run.curve, strict=True), marker="o", label=f"eval accuracy (greedy, {eval_label})")
    if run.rewards:
        steps, rewards = zip(*run.rewards, strict=True)
        ax.plot(steps, rewards, alpha=0.5, label="mean training reward")
    ax.set_xlabel("trainer step")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"GRPO on {digits}-digit addition (tiny transformer, from scratch)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> DemoConfig:
    """The demo's settings from command-line arguments (``None`` reads ``sys.argv``)."""
    p = argparse.ArgumentParser(prog="rollhub demo arithmetic", description=__doc__.split("\n")[0])
    d = DemoConfig()
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="most trainer steps")
    p.add_argument("--target", type=float, default=d.target, help="stop at this evaluation accuracy")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--n-prompts", type=int, default=d.n_prompts, help="prompts (groups) per batch")
    p.add_argument("--group-size", type=int, default=d.group_size, help="completions per prompt")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--entropy-coef", type=float, default=d.entropy_coef)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="trainer steps between evaluations")
    p.add_argument("--max-wall-s", type=float, default=d.max_wall_s, help="stop after this many seconds")
    p.add_argument(
        "--holdout-fraction",
        type=float,
        default=None,
        help="never train on this share (default 0, or 0.05 with --digits 2)",
    )
    p.add_argument(
        "--out-dir", type=Path, default=d.out_dir, help="where the PNG, rollouts and checkpoints go"
    )
    p.add_argument("--summary-json", type=Path, default=None, help="also write the summary JSON here")
    p.add_argument("--digits", type=int, choices=(1, 2), default=d.digits, help="digits per operand")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    a = p.parse_args(argv)
    return DemoConfig(**vars(a))


def main(argv: list[str] | None = None) -> int:
    """Run the demo; print the JSON summary as the last line. Returns 0 if the target was reached, else 1."""
    cfg = parse_args(argv)
    torch.set_num_threads(1)  # tiny matrices: more threads only add synchronisation on a busy CPU
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    run = build(cfg)
    try:
        steps = train(run, cfg)
    finally:
        run.eval_writer.close()
        run.manager.shutdown()
    wall_s = time.monotonic() - started
    if steps not in run.checkpoints.steps():
        run.checkpoints.save(steps, run.trainer.model.state_dict(), {"task": "arithmetic", "final": True})
    eval_label = task(cfg).eval_label
    plot(run, cfg.out_dir / "learning_curve.png", eval_label, cfg.digits)
    summary = {
        "eval_accuracy": run.curve[-1][1],
        "initial_eval_accuracy": run.curve[0][1],
        "eval_problems": eval_label,
        "steps": steps,
        "wall_s": round(wall_s, 1),
        "target": cfg.target,
        "curve": [[s, round(a, 4)] for s, a in run.curve],
        "curriculum": run.manager.curriculum.metrics(),
        "out_dir": str(cfg.out_dir),
    }
    text = json.dumps(summary)
    if cfg.summary_json is not None:
        cfg.summary_json.parent.mkdir(parents=True, exist_ok=True)
        cfg.summary_json.write_text(text + "\n")
    print(text)
    return 0 if summary["eval_accuracy"] >= cfg.target else 1


if __name__ == "__main__":
    sys.exit(main())
