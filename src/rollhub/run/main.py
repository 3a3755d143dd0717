"""``rollhub run``: run a config file (or resume a run directory) and report like the demos do.

Exit codes: 0 when the run reached its target (``run.target_return`` of a step run, ``eval.target_accuracy``
of a group run; with none, when it ended by its limits); 1 when
a limit came first; 2 for a config that cannot run (nothing is started); ``128 + N`` when signal N stopped it
(the summary, the PNG and a final checkpoint are written in every case but 2, and but a signal that came while
an inference engine was starting: then the engine is stopped at once and nothing was trained).

An ``env.id`` naming the user's own package (``"mypkg.corridor:Corridor"``) is found without installing it when
``mypkg/`` is beside the config file or in the current directory (:mod:`rollhub.run.user_code`).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from rollhub.errors import StopRequested
from rollhub.run.config import RunConfig, RunConfigError, load_config, read_toml
from rollhub.run.progress import PERCENT_HELP
from rollhub.run.rundir import CONFIG, RunDirectory
from rollhub.run.toml import dumps
from rollhub.run.user_code import add_user_code_dirs

SHIPPED = "rollhub.run.configs"


def parser(prog: str = "rollhub run") -> argparse.ArgumentParser:
    """The command line of ``rollhub run``."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run training from a TOML config: environment, policy, rollout fleet, trainer, run directory.",
    )
    p.add_argument(
        "config",
        nargs="?",
        type=Path,
        help="the TOML config file; env.id may name a package beside it or in the current directory",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, e.g. --set trainer.lr=3e-4 (repeatable; beats the file and ROLLHUB_*)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config as TOML (the sections that apply to this run) and exit",
    )
    p.add_argument(
        "--no-progress", action="store_true", help=f"no live progress line (run.progress = false); {PERCENT_HELP}"
    )
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue RUN_DIR from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in run.dir instead of refusing")
    p.add_argument("--summary-json", type=Path, default=None, help="also write the summary JSON here")
    return p


def shipped_text(name: str) -> str:
    """The text (comments and all) of the config shipped in the package as ``rollhub/run/configs/NAME.toml``."""
    return resources.files(SHIPPED).joinpath(f"{name}.toml").read_text()


def shipped_config(name: str) -> dict[str, Any]:
    """The config shipped in the package as ``rollhub/run/configs/NAME.toml``, parsed."""
    import tomllib

    return tomllib.loads(shipped_text(name))


def applicable_sections(config: RunConfig) -> dict[str, Any]:
    """``config`` as plain data without the sections its run never reads: ``[curriculum]``, ``[eval]`` and
    ``[sampling]`` outside a group run, ``[inference]`` outside a Hugging Face (``policy.kind = "hf"``) run."""
    unused = set()
    if config.env.kind != "group":
        unused |= {"curriculum", "eval", "sampling"}
    if config.policy.kind != "hf":
        unused.add("inference")
    return {key: value for key, value in config.model_dump(mode="json").items() if key not in unused}


def effective_config(args: argparse.Namespace) -> RunConfig:
    """The config of ``args``: its file (or the resumed run's ``config.toml``), ``ROLLHUB_*``, ``--set``."""
    if (args.config is None) == (args.resume is None):
        raise RunConfigError("give either CONFIG.toml or --resume RUN_DIR (exactly one)")
    if args.resume is not None:
        data = read_toml(args.resume / CONFIG)
        return load_config(data, [*args.sets, f"run.dir={json.dumps(str(args.resume))}"], source=str(args.resume))
    return load_config(read_toml(args.config), args.sets, source=str(args.config))


def execute(config: RunConfig, *, resume: bool = False, overwrite: bool = False,
            summary_json: Path | None = None) -> int:  # fmt: skip
    """Run ``config`` (resuming its run directory when ``resume``); print the summary; return the exit code.

    Raises:
        RunConfigError: the config cannot run (checked before anything starts).
    """
    from rollhub.run.progress import say
    from rollhub.run.signals import StopSignals

    group = config.env.kind in ("group", "external")
    if group:  # the group path's modules (transformers, the server client) load only for group runs
        from rollhub.run.group import run_group_path
        from rollhub.run.group_parts import probe_group_env

        shape = probe_group_env(config)
    else:
        from rollhub.run.step import run_step_path
        from rollhub.run.step_parts import probe_env

        shape = probe_env(config)
    rundir = RunDirectory(config.run.dir, keep_checkpoints=config.run.keep_checkpoints)
    resumed = rundir.latest_checkpoint() if resume else None
    if not resume and rundir.holds_a_run():
        if not overwrite:
            raise RunConfigError(
                f"run.dir: {rundir.root} already holds a run; continue it with --resume {rundir.root}, "
                "replace it with --overwrite, or set another run.dir"
            )
        rundir.clear()
    rundir.write_config(config)
    note = say if config.run.progress else (lambda _msg: None)
    with StopSignals() as stop:
        try:
            if group:
                summary = run_group_path(config, rundir, resumed, stop, note)
            else:
                summary = run_step_path(config, rundir, resumed, stop, note, shape)
        except StopRequested as exc:  # before training started: nothing to summarize
            print(f"{config.run.name}: {exc} (stopped by {stop.signal_name}); nothing was trained", file=sys.stderr)
            return stop.exit_code
    if summary_json is not None:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        summary_json.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    if stop.requested:
        return stop.exit_code
    reached = summary["stop_reason"] == "target reached"
    target = config.eval.target_accuracy if group else config.run.target_return
    return 0 if reached or target is None else 1


def main(argv: list[str] | None = None, prog: str = "rollhub run") -> int:
    """Entry point of ``rollhub run``."""
    args = parser(prog).parse_args(argv)
    if args.no_progress:
        args.sets.append("run.progress=false")
    try:
        config = effective_config(args)
        if args.print_config:
            print(dumps(applicable_sections(config)), end="")
            return 0
        add_user_code_dirs(args.config)  # a package beside the config or in the current directory imports
        return execute(config, resume=args.resume is not None, overwrite=args.overwrite,
                       summary_json=args.summary_json)  # fmt: skip
    except RunConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
