"""What ``rollhub demo arithmetic`` learns and how, shared by the distributed and the ``--in-process`` runs.

Both runs train the same policy on the same problems with the same GRPO settings and evaluate the same way;
they differ only in how rollouts reach the trainer (a Ray fleet through ``rollhub serve``, or a queue in one
process). The problem is ``a+b`` for ``a, b`` in ``0..max_operand`` (operands zero-padded); a seeded share of
the pairs (``holdout_fraction``) is never trained on, and evaluation decodes greedily over every one of those
held-out pairs, so the reported accuracy measures whether the policy learned to add, not the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rollhub.curriculum import CurriculumConfig, LessonConfig
from rollhub.demos.progress import share
from rollhub.envs.group.scored import GroupStats
from rollhub.experience import Group
from rollhub.inference.tokenizer import CharTokenizer
from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer, TransformerConfig
from rollhub.rollout.group_manager import GroupRolloutManager
from rollhub.rollout.protocols import SampleRequest
from rollhub.train.grpo import GRPOConfig

MAX_LEN = 16  # "<bos>99+99=" and a three-digit answer with its end token fit


@dataclass(frozen=True, slots=True)
class ArithmeticConfig:
    """Settings of one run (see ``rollhub demo arithmetic --help`` for each)."""

    in_process: bool = False
    max_steps: int = 3000
    target: float = 0.9
    seed: int = 0
    n_prompts: int = 32
    group_size: int = 16
    lr: float = 1e-3
    lr_final: float = 1e-4
    entropy_coef: float = 0.2
    entropy_coef_final: float = 0.2
    anneal_steps: int = 3000
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

    def grpo(self) -> GRPOConfig:
        """The trainer's hyper-parameters."""
        return GRPOConfig(
            lr=self.lr,
            entropy_coef=self.entropy_coef,
            max_staleness=self.max_staleness,
            anneal_steps=self.anneal_steps,
            lr_final=self.lr_final,
            entropy_coef_final=self.entropy_coef_final,
        )

    def eval_problems(self) -> str:
        """How the summary and the plot name the evaluation set."""
        n = (self.max_operand + 1) ** 2
        return f"{round(self.holdout_fraction * n)} held-out of {n} problems (never trained on)"


def curriculum(cfg: ArithmeticConfig) -> CurriculumConfig:
    """One lesson, ``add``: ``a+b=`` with operands zero-padded, a seeded share of the pairs held out of
    training and used for evaluation only."""
    args = {
        "name": "add",
        "max_operand": cfg.max_operand,
        "holdout_fraction": cfg.holdout_fraction,
        "pad_operands": True,
        "width": len(str(2 * cfg.max_operand)),
    }
    lesson = LessonConfig("add", "arithmetic", args, (), cfg.n_prompts, cfg.group_size, cfg.target)
    return CurriculumConfig(  # eval draws every held-out problem; workers evaluate every worker_eval_every turns
        lessons=(lesson,), eval_n_examples=10**6, eval_frequency=cfg.worker_eval_every, micro_eval_frequency=0
    )


def model_shape(cfg: ArithmeticConfig) -> TransformerConfig:
    """The policy's shape (character vocabulary)."""
    return TransformerConfig(
        vocab_size=CharTokenizer().vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=4, max_len=MAX_LEN
    )


def build_policy(shape: TransformerConfig, seed: int) -> LocalPolicy:
    """A freshly initialised tiny transformer (seeded), in eval mode."""
    torch.manual_seed(seed)
    model = TinyTransformer(shape)
    model.eval()
    return LocalPolicy(model, CharTokenizer())


def evaluate(
    evaluator: GroupRolloutManager, model: nn.Module, step: int, rng: np.random.Generator
) -> tuple[GroupStats, list[Group]]:
    """Greedy exact-answer evaluation of ``model``'s weights (version ``step``) on every held-out problem."""
    evaluator.update_model({k: v.detach().clone() for k, v in model.state_dict().items()})
    request = SampleRequest(step, "eval", lesson_id="add", mode="eval", n_examples=10**6, seed=int(rng.integers(2**31)))
    result = evaluator.sample_batch(request)
    groups = [g for g in result.items if isinstance(g, Group)]
    return result.stats or GroupStats.of(groups, "add"), groups


def plot(eval_curve: list[tuple[int, float]], rewards: list[tuple[int, float]], title: str, path: Path) -> None:
    """Held-out accuracy and mean training reward against trainer steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*eval_curve, strict=True), marker="o", markersize=3, label="held-out accuracy (greedy)")
    if rewards:
        ax.plot(*zip(*rewards, strict=True), alpha=0.5, label="mean training reward")
    ax.set_xlabel("trainer step (= policy version)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    """Every flag of ``rollhub demo arithmetic``, with ``--in-process`` and the flags only the distributed
    run reads marked as such."""
    d = ArithmeticConfig()
    p = argparse.ArgumentParser(
        prog="rollhub demo arithmetic",
        description="GRPO teaches a tiny transformer two-digit addition from scratch on a CPU; accuracy is "
        "measured on held-out problems it never trains on. By default distributed (rollhub serve, a Ray fleet "
        "of rollout workers, the trainer pulling batches over HTTP); --in-process runs the same learning "
        "setup in one process. The last line of stdout is a JSON summary; exit 0 when the target was reached, "
        "1 when a limit was hit first, 128+N when stopped by signal N (SIGINT, SIGTERM: summary and PNG are "
        "still written).",
    )
    add = p.add_argument
    add("--in-process", action="store_true", help="one process, no server or Ray (same learning setup)")
    add("--max-steps", type=int, default=d.max_steps, help="most trainer steps (default %(default)s)")
    add("--max-wall-s", type=float, default=d.max_wall_s, help="stop after this many seconds (default %(default)s)")
    add("--target", type=float, default=d.target, help="stop at this held-out accuracy (default %(default)s)")
    add("--seed", type=int, default=d.seed, help="model, sampling and evaluation seed (default %(default)s)")
    add("--n-prompts", type=int, default=d.n_prompts, help="prompts (groups) per batch (default %(default)s)")
    add("--group-size", type=int, default=d.group_size, help="completions per prompt (default %(default)s)")
    add("--lr", type=float, default=d.lr, help="Adam learning rate at step 0 (default %(default)s)")
    add("--lr-final", type=float, default=d.lr_final, help="learning rate after --anneal-steps (default %(default)s)")
    add("--entropy-coef", type=float, default=d.entropy_coef, help="entropy bonus at step 0 (default %(default)s)")
    add("--entropy-coef-final", type=float, default=d.entropy_coef_final, help="after --anneal-steps (%(default)s)")
    add("--anneal-steps", type=int, default=d.anneal_steps, help="cosine decay length, 0: none (%(default)s)")
    add("--eval-every", type=int, default=d.eval_every, help="trainer steps between evaluations (%(default)s)")
    add("--max-operand", type=int, default=d.max_operand, help="operands range over 0..N (default %(default)s)")
    add("--holdout-fraction", type=float, default=d.holdout_fraction, help="share never trained on (%(default)s)")
    add("--d-model", type=int, default=d.d_model, help="transformer width (default %(default)s)")
    add("--n-layers", type=int, default=d.n_layers, help="transformer blocks (default %(default)s)")
    add("--max-staleness", type=int, default=d.max_staleness, help="policy versions data may lag (%(default)s)")
    add("--workers", type=int, default=d.workers, help="distributed only: rollout worker actors (%(default)s)")
    add("--worker-eval-every", type=int, default=d.worker_eval_every, help="distributed only: worker eval, 0 off")
    add("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints, 0: last only")
    add("--out-dir", type=Path, default=d.out_dir, help="where the PNG, checkpoints and logs go (%(default)s)")
    add("--summary-json", type=Path, default=None, help="also write the summary JSON to this file")
    add("--no-progress", dest="progress", action="store_false", help="no progress line on stderr")
    return p


def parse_args(argv: list[str] | None) -> ArithmeticConfig:
    """The run's settings from command-line arguments (``None`` reads ``sys.argv``); bad values exit 2 with
    a message naming the flag."""
    p = parser()
    cfg = ArithmeticConfig(**vars(p.parse_args(argv)))
    for name in ("max_steps", "n_prompts", "group_size", "eval_every", "max_operand", "d_model", "n_layers"):
        if getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if not 0.0 < cfg.holdout_fraction < 1.0:
        p.error(f"--holdout-fraction must be in (0, 1) (evaluation uses held-out problems), got {cfg.holdout_fraction}")
    if cfg.d_model % 4:
        p.error(f"--d-model must be a multiple of 4 (4 attention heads), got {cfg.d_model}")
    return cfg


def finish(cfg: ArithmeticConfig, summary: dict[str, Any], stop_code: int) -> int:
    """Write the summary (stdout's last line, and ``--summary-json``); the exit status: ``stop_code`` when a
    signal stopped the run, else 0 if the target was reached and 1 if not."""
    text = json.dumps(summary)
    if cfg.summary_json is not None:
        cfg.summary_json.parent.mkdir(parents=True, exist_ok=True)
        cfg.summary_json.write_text(text + "\n")
    print(text)
    sys.stdout.flush()
    if stop_code:
        return stop_code
    return 0 if summary["eval_accuracy"] >= cfg.target else 1


@dataclass
class Record:
    """What a run records for the progress line, the plot and the summary.

    Attributes:
        eval: ``(step, held-out accuracy)`` per evaluation.
        reward: ``(step, mean training reward)`` per trainer step.
        best: the best held-out accuracy so far.
        stopped_by: the signal that stopped the run, or None.
    """

    eval: list[tuple[int, float]] = field(default_factory=list)
    reward: list[tuple[int, float]] = field(default_factory=list)
    best: float = 0.0
    stopped_by: str | None = None

    def add_eval(self, step: int, accuracy: float) -> None:
        """Record one evaluation."""
        self.eval.append((step, accuracy))
        self.best = max(self.best, accuracy)

    def fraction(self, cfg: ArithmeticConfig, step: int, elapsed_s: float) -> float:
        """Progress toward whichever stopping condition is nearest: the target, the step or the time limit."""
        return max(share(self.best, cfg.target), share(step, cfg.max_steps), share(elapsed_s, cfg.max_wall_s))

    def outcome(self, cfg: ArithmeticConfig) -> tuple[str, bool]:
        """How the run ended, and whether the target was reached."""
        reached = bool(self.eval) and self.eval[-1][1] >= cfg.target
        if reached:
            return "target reached", True
        return (f"stopped by {self.stopped_by}" if self.stopped_by else "limit reached"), False

    def summary(self, cfg: ArithmeticConfig, steps: int, wall_s: float) -> dict[str, Any]:
        """The fields both runs report."""
        rewards = [r for _, r in self.reward]
        reached_at = next((s for s, a in self.eval if a >= cfg.target), None)
        return {
            "eval_accuracy": self.eval[-1][1],
            "initial_eval_accuracy": self.eval[0][1],
            "best_eval_accuracy": self.best,
            "eval_problems": cfg.eval_problems(),
            "steps": steps,
            "target_reached_at_step": reached_at,
            "wall_s": round(wall_s, 1),
            "target": cfg.target,
            "stopped_by": self.stopped_by,
            "curve": [[s, round(a, 4)] for s, a in self.eval],
            "train_reward_first10": round(float(np.mean(rewards[:10])), 4) if rewards else None,
            "train_reward_last10": round(float(np.mean(rewards[-10:])), 4) if rewards else None,
            "out_dir": str(cfg.out_dir),
        }
