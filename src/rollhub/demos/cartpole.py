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

from rollhub.demos.options import add_common, plain, run_demo, write_config
from rollhub.demos.options import overrides as common_overrides

# option -> config key it overrides
OPTIONS = {
    "workers": "fleet.workers",
    "envs_per_worker": "fleet.envs_per_worker",
    "env_processes": "fleet.env_processes",
    "fragment_length": "fleet.fragment_length",
    "batch_fragments": "writer.batch_size",
    "max_staleness": "writer.max_staleness",
    "lr": "trainer.lr",
    "target_return": "run.target_return",
    "window": "run.window",
    "max_seconds": "run.max_seconds",
    "seed": "run.seed",
    "out_dir": "run.dir",
}


def parser() -> argparse.ArgumentParser:
    """The demo's command line (defaults: the shipped config's values)."""
    p = argparse.ArgumentParser(prog="rollhub demo cartpole", description=plain(__doc__.splitlines()[0]))
    p.add_argument("--workers", type=int, help="RolloutWorkers (1)")
    p.add_argument("--envs-per-worker", type=int, help="environments per worker (8)")
    p.add_argument("--env-processes", type=int, help="processes per worker's environments (0: in the worker)")
    p.add_argument("--fragment-length", type=int, help="steps per SampleFragment (32)")
    p.add_argument("--batch-fragments", type=int, help="fragments per PPO update (16)")
    p.add_argument("--max-staleness", type=int, help="policy versions a step may lag the trainer (2)")
    p.add_argument("--lr", type=float, help="Adam learning rate (1e-3)")
    p.add_argument("--target-return", type=float, help="stop at this mean over --window episodes (475)")
    p.add_argument("--window", type=int, help="episodes in the running mean (20)")
    p.add_argument("--max-seconds", type=float, help="give up after this long (600)")
    p.add_argument("--seed", type=int, help="seed of the learner and the environments (0)")
    p.add_argument("--out-dir", type=Path, help="the run directory (rollhub-runs/cartpole)")
    add_common(p)
    return p


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
