"""The options every config-backed demo shares: its run directory summary, progress and ``--set`` overrides."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path


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
