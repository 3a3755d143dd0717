"""Start a trainer-only ``rollhub run`` and the Atropos example environment pointed at it; wait for the run.

What ``make demo-atropos`` runs, from the repository root. The two processes are the ones a person starts in
two terminals (docs/atropos-training.md): first the run, which builds the tiny model, starts the buffer server
and the vLLM engine and writes ``RUN_DIR/endpoints.json``; then the environment in ``serve`` mode with those
values. When the run ends (target, limit, Ctrl-C) the environment is stopped.

    python examples/atropos_env/run_demo.py [--set KEY=VALUE ...] [-- ENVIRONMENT FLAGS ...]

The environment's own evaluations go to ``RUN_DIR/env_eval.jsonl`` and the groups it sent to
``RUN_DIR/env_groups.jsonl`` (atroposlib's ``data_path_to_save_groups``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("config.toml")
ENV_MODULE = "examples.atropos_env.env"


def atropos_path() -> list[str]:
    """Where atroposlib and the packages its BaseEnv needs were installed (``make setup``, ``make atropos-env``)."""
    venv = Path(sys.prefix)
    return [str(venv / "reference"), str(venv / "reference-env")]


def child_env(extra: list[str]) -> dict[str, str]:
    """This environment with ``extra`` and the repository root in front of ``PYTHONPATH``."""
    paths = [*extra, str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def run_dir(config: Path, sets: list[str]) -> Path:
    """``run.dir`` of the config (a ``--set run.dir=...`` wins), relative to the repository root."""
    value = tomllib.loads(config.read_text())["run"]["dir"]
    for assignment in sets:
        key, _, raw = assignment.partition("=")
        if key.strip() == "run.dir":
            value = tomllib.loads(f"v = {raw}")["v"]
    return (REPO / value).resolve()


def environment_command(endpoints: dict, directory: Path, extra: list[str]) -> list[str]:
    """The example environment's ``serve`` command line for the run at ``endpoints`` (what the run prints, plus
    where the environment logs its evaluations and the groups it sends)."""
    from rollhub.run.external import Endpoints

    logs = ["--env.eval_log", str(directory / "env_eval.jsonl"),
            "--env.data_path_to_save_groups", str(directory / "env_groups.jsonl")]  # fmt: skip
    return [sys.executable, "-m", ENV_MODULE, "serve", *Endpoints(**endpoints).atropos_flags(), *logs, *extra]


def wait_for(path: Path, run: subprocess.Popen[bytes]) -> dict:
    """The endpoints the run writes once its server and engine answer (``None`` if the run ended first)."""
    while not path.exists():
        if run.poll() is not None:
            raise SystemExit(f"the run ended with status {run.returncode} before it wrote {path}")
        time.sleep(0.5)
    return json.loads(path.read_text())


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGINT to the process group (Python ends cleanly and flushes its files), then SIGTERM, then SIGKILL,
    30 s apart."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            pass


def main(argv: list[str] | None = None) -> int:
    """Run both; return the run's exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    env_extra = args[args.index("--") + 1 :] if "--" in args else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parsed = parser.parse_args(args[: args.index("--")] if "--" in args else args)
    directory = run_dir(parsed.config, parsed.sets)
    (directory / "endpoints.json").unlink(missing_ok=True)
    sets = [a for s in parsed.sets for a in ("--set", s)]
    cmd = [sys.executable, "-m", "rollhub", "run", str(parsed.config), "--overwrite", *sets]
    run = subprocess.Popen(cmd, cwd=REPO, env=child_env([]), start_new_session=True)
    environment = None
    try:
        endpoints = wait_for(directory / "endpoints.json", run)
        for name in ("env_eval.jsonl", "env_groups.jsonl"):
            (directory / name).unlink(missing_ok=True)
        with open(directory / "env.log", "wb") as log:
            environment = subprocess.Popen(
                environment_command(endpoints, directory, env_extra), cwd=REPO, env=child_env(atropos_path()),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        print(f"environment pid {environment.pid}, its output in {directory / 'env.log'}", file=sys.stderr)
        return run.wait()
    except KeyboardInterrupt:
        os.killpg(run.pid, signal.SIGINT)
        return run.wait()
    finally:
        if environment is not None:
            stop(environment)
        stop(run)


if __name__ == "__main__":
    sys.exit(main())
