"""What every config-backed demo shares: the summary, progress and ``--set`` options, the in-process writer
switch, and running the config with a config error reported as exit 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def add_common(p: argparse.ArgumentParser) -> None:
    """``--summary-json``, ``--no-progress`` and ``--set KEY=VALUE``."""
    p.add_argument("--summary-json", type=Path, default=None, help="also write the summary JSON here")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key of the shipped config, as for rollhub run")  # fmt: skip


def overrides(args: argparse.Namespace, options: Mapping[str, str]) -> list[str]:
    """The ``--set`` assignments the ``options`` (option -> config key) stand for, then the explicit ones."""
    sets = [f"{key}={json.dumps(str(v) if isinstance(v, Path) else v)}" for opt, key in options.items()
            if (v := getattr(args, opt)) is not None]  # fmt: skip
    if args.no_progress:
        sets.append("run.progress=false")
    return [*sets, *args.sets]


def in_process(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a shipped group config) with its server writer replaced by the in-process writer, which keeps only
    the staleness bound of the server writer's keys."""
    return {**data, "writer": {"kind": "in_process", "max_staleness": data["writer"]["max_staleness"]}}


def run_demo(name: str, build: Callable[[], Any], summary_json: Path | None) -> int:
    """Build the demo's config and run it, replacing a previous demo run in its directory; return the exit code
    (a config that cannot run is printed, naming its key: 2)."""
    from rollhub.run.config import RunConfigError
    from rollhub.run.main import execute

    try:
        return execute(build(), overwrite=True, summary_json=summary_json)
    except RunConfigError as exc:
        print(f"rollhub demo {name}: {exc}", file=sys.stderr)
        return 2
