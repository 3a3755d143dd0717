"""``rollhub demo arithmetic``: a tiny transformer learns two-digit addition by GRPO from scratch on a CPU.

The demo is ``rollhub run`` on the shipped config ``rollhub/run/configs/arithmetic.toml`` (copy it to edit with
``rollhub demo arithmetic --write-config my.toml``, then ``rollhub run my.toml``): the group environment
:class:`~rollhub.envs.group.arithmetic.ArithmeticEnv` (``a+b`` for ``a, b`` in ``0..max_operand``, operands
zero-padded, a seeded share of the pairs held out of training), the built-in tiny transformer, the GRPO
trainer, and held-out evaluation by greedy decoding over every held-out pair. By default the run is
distributed (``rollhub serve``, a Ray fleet of group rollout workers, the trainer pulling through
``TrainerClient``); ``--in-process`` is the ``in_process`` writer (one process, no server, no Ray). The flags
below are shortcuts for keys of that config.

Outputs in ``--out-dir`` (the run directory): ``arithmetic_learning_curve.png``, ``eval_rollouts.jsonl``,
``checkpoints/``, ``metrics.jsonl``, and for the distributed run ``rollhub.db`` and one tracker file per worker;
the last line of stdout (and ``--summary-json``) is a JSON summary with ``eval_accuracy``, ``steps`` and
``wall_s``. Exit 0 when the target was reached, 1 when a limit came first, 2 for bad flags, 128+N when signal
N stopped the run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rollhub.demos.options import add_deprecated_alias, add_write_config, in_process, run_demo, write_config
from rollhub.run.config import RunConfig, load_config
from rollhub.run.main import shipped_config
from rollhub.run.progress import PERCENT_HELP

_FLAGS: dict[str, tuple[str, str, type]] = {  # flag -> (config key, help, type)
    "max_steps": ("run.max_updates", "most trainer steps", int),
    "max_seconds": ("run.max_seconds", "stop after this many seconds", float),
    "target": ("eval.target_accuracy", "stop at this held-out accuracy", float),
    "seed": ("run.seed", "model, sampling and evaluation seed", int),
    "n_prompts": ("trainer.groups_per_batch", "prompts (groups) per batch", int),
    "group_size": ("env.group_size", "completions per prompt", int),
    "lr": ("trainer.lr", "Adam learning rate at step 0", float),
    "lr_final": ("trainer.lr_final", "learning rate after --anneal-steps", float),
    "entropy_coef": ("trainer.entropy_coef", "entropy bonus at step 0", float),
    "entropy_coef_final": ("trainer.entropy_coef_final", "entropy bonus after --anneal-steps", float),
    "anneal_steps": ("trainer.anneal_steps", "cosine decay length, 0: none", int),
    "eval_every": ("eval.every", "trainer steps between evaluations", int),
    "max_operand": ("env.kwargs.max_operand", "operands range over 0..N", int),
    "holdout_fraction": ("env.kwargs.holdout_fraction", "share of problems never trained on", float),
    "d_model": ("policy.d_model", "transformer width", int),
    "n_layers": ("policy.n_layers", "transformer blocks", int),
    "max_staleness": ("writer.max_staleness", "policy versions data may lag", int),
    "workers": ("fleet.workers", "distributed only: rollout worker actors", int),
    "worker_eval_every": ("curriculum.eval_every", "distributed only: worker evaluation turns, 0: off", int),
    "checkpoint_every": ("run.checkpoint_every", "steps between checkpoints, 0: last only", int),
    "out_dir": ("run.dir", "the run directory: PNG, checkpoints, logs", Path),
}


def parser() -> argparse.ArgumentParser:
    """Every flag of ``rollhub demo arithmetic``; the defaults are the shipped config's."""
    p = argparse.ArgumentParser(
        prog="rollhub demo arithmetic",
        description="GRPO teaches a tiny transformer two-digit addition from scratch on a CPU; accuracy is "
        "measured on held-out problems it never trains on. This is 'rollhub run' on the shipped arithmetic "
        "config: by default distributed (rollhub serve, a Ray fleet of rollout workers, the trainer pulling "
        "batches over HTTP); --in-process runs the same learning setup in one process. The last line of stdout "
        "is a JSON summary; exit 0 when the target was reached, 1 when a limit was hit first, 128+N when "
        "stopped by signal N (SIGINT, SIGTERM: summary and PNG are still written).",
    )
    p.add_argument("--in-process", action="store_true", help="one process, no server or Ray (writer.kind)")
    for name, (key, text, kind) in _FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"{text} ({key})")
    add_deprecated_alias(p, "--max-wall-s", "--max-seconds", float)
    p.add_argument("--summary-json", type=Path, default=None, help="also write the summary JSON to this file")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help=f"no progress line on stderr; {PERCENT_HELP}")  # fmt: skip
    add_write_config(p)
    return p


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    *tables, last = key.split(".")
    for table in tables:
        data = data.setdefault(table, {})
    data[last] = value


def demo_config(args: argparse.Namespace) -> RunConfig:
    """The shipped arithmetic config with the flags of ``args`` applied (and ``ROLLHUB_*`` variables).

    Raises:
        RunConfigError: a flag's value does not fit its key (the message names the key).
    """
    data = in_process(shipped_config("arithmetic")) if args.in_process else shipped_config("arithmetic")
    for name, (key, _, _) in _FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            _put(data, key, str(value) if isinstance(value, Path) else value)
    kwargs = data["env"]["kwargs"]
    kwargs["width"] = len(str(2 * kwargs["max_operand"]))  # every sum fits, zero-padded
    if args.checkpoint_every == 0:
        data["run"]["checkpoint_every"] = 10**9  # only the final checkpoint
    data["run"]["progress"] = args.progress
    return load_config(data, source="the arithmetic config with these flags (--help names the key of each)")


def main(argv: list[str] | None = None) -> int:
    """``rollhub demo arithmetic [--in-process] ...``: run the shipped config; return the exit code."""
    p = parser()
    args = p.parse_args(argv)
    if args.write_config is not None:
        return write_config("arithmetic", args.write_config, p, args)
    return run_demo("arithmetic", lambda: demo_config(args), args.summary_json)


if __name__ == "__main__":
    sys.exit(main())
