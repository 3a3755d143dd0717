"""``rollhub demo cartpole``: PPO on CartPole-v1 with a local rollout fleet, to a mean return >= 475.

This is ``rollhub run`` on the config shipped as ``rollhub/run/configs/cartpole.toml``; each option below
overrides one key of it (``--set KEY=VALUE`` overrides any other; ``--write-config PATH`` writes the config
to a file to edit and run with ``rollhub run PATH``). The run directory (``--out-dir``) gets the
effective config, ``metrics.jsonl``, ``episodes.jsonl``, checkpoints and the learning-curve PNG; a previous
demo run there is replaced. Prints a live progress line and ends with one line of JSON.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rollhub.demos.options import Option, demo_parser, run_demo, write_config
from rollhub.demos.options import overrides as common_overrides

OPTIONS: dict[str, Option] = {  # option -> (config key it overrides, help, type)
    "workers": ("fleet.workers", "RolloutWorkers (1)", int),
    "envs_per_worker": ("fleet.envs_per_worker", "environments per worker (8)", int),
    "env_processes": ("fleet.env_processes", "processes per worker's environments (0: in the worker)", int),
    "fragment_length": ("fleet.fragment_length", "steps per SampleFragment (32)", int),
    "batch_fragments": ("writer.batch_size", "fragments per PPO update (16)", int),
    "max_staleness": ("writer.max_staleness", "policy versions a step may lag the trainer (2)", int),
    "lr": ("trainer.lr", "Adam learning rate (1e-3)", float),
    "target_return": ("run.target_return", "stop at this mean over --window episodes (475)", float),
    "window": ("run.window", "episodes in the running mean (20)", int),
    "max_seconds": ("run.max_seconds", "give up after this long (600)", float),
    "seed": ("run.seed", "seed of the learner and the environments (0)", int),
    "out_dir": ("run.dir", "the run directory (rollhub-runs/cartpole)", Path),
}


def parser() -> argparse.ArgumentParser:
    """The demo's command line (defaults: the shipped config's values)."""
    return demo_parser("cartpole", __doc__, OPTIONS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The demo's options parsed from ``argv``."""
    return parser().parse_args(argv)


def overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` assignments the options stand for, then the explicit ``--set`` ones."""
    return common_overrides(args, OPTIONS)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return 0 when the target mean return was reached, 1 when the time ran out first, 2 for a
    config that cannot run, and ``128 + N`` when signal N stopped it (the summary and the PNG are written in every
    case)."""
    from rollhub.run.config import load_config
    from rollhub.run.main import shipped_config

    p = parser()
    args = p.parse_args(argv)
    if args.write_config is not None:
        return write_config("cartpole", args.write_config, p, args)
    build = lambda: load_config(shipped_config("cartpole"), overrides(args), source="the cartpole config")  # noqa: E731
    return run_demo("cartpole", build, args.summary_json)


if __name__ == "__main__":
    raise SystemExit(main())
