"""What every config-backed demo shares: the summary, progress and ``--set`` options, ``--write-config`` (a copy
of the shipped config to edit and run with ``rollhub run``), deprecated option names, the in-process writer
switch, the options that stand for config keys, and running the config with a config error reported as exit 2."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rollhub.run.progress import PERCENT_HELP

Option = tuple[str | None, str, type]
"""A demo option: the config key it overrides (``None``: a switch of the demo's own), its help, its type (``bool``: a
switch, off unless given)."""

_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")  # :class:`~a.b.C`, :mod:`a.b`


def plain(docstring: str) -> str:
    """``docstring`` as plain text for ``--help``: a reST role reduced to the name it holds (the last part
    after ``~``, as Sphinx shows it) and double backquotes dropped."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), docstring)
    return text.replace("``", "")


def add_common(p: argparse.ArgumentParser) -> None:
    """``--summary-json``, ``--no-progress``, ``--set KEY=VALUE`` and ``--write-config``."""
    p.add_argument("--summary-json", type=Path, default=None, help="also write the summary JSON here")
    p.add_argument("--no-progress", action="store_true", help=f"no live progress line; {PERCENT_HELP}")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override any key of the shipped config, as for rollhub run")  # fmt: skip
    add_write_config(p)


def demo_parser(name: str, doc: str, options: Mapping[str, Option]) -> argparse.ArgumentParser:
    """The command line of ``rollhub demo NAME``: the first line of its module docstring ``doc`` as description,
    its ``options`` (:func:`add_options`), then the common ones (:func:`add_common`)."""
    p = argparse.ArgumentParser(prog=f"rollhub demo {name}", description=plain(doc.splitlines()[0]))
    add_options(p, options)
    add_common(p)
    return p


def add_options(p: argparse.ArgumentParser, options: Mapping[str, Option]) -> None:
    """``--NAME`` for every entry of ``options`` (option -> :data:`Option`), in its order. None has a default: an
    option not given leaves its key as the config has it."""
    for name, (_, text, kind) in options.items():
        flag = f"--{name.replace('_', '-')}"
        if kind is bool:
            p.add_argument(flag, action="store_true", help=text)
        else:
            p.add_argument(flag, type=kind, help=text)


def add_write_config(p: argparse.ArgumentParser) -> None:
    """``--write-config PATH``: write the demo's shipped config there and run nothing."""
    p.add_argument(
        "--write-config",
        type=Path,
        metavar="PATH",
        help="write this demo's shipped config (with its comments) to PATH ('-': stdout) to edit and run with "
        "'rollhub run PATH', and run nothing",
    )


def add_deprecated_alias(p: argparse.ArgumentParser, old: str, new: str, kind: type) -> None:
    """Let ``old`` (left out of ``--help``) still set what ``new`` sets, with a note on stderr to use ``new``."""
    prog = p.prog

    class Alias(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                     option_string: str | None = None) -> None:  # fmt: skip
            print(f"{prog}: {old} is deprecated; use {new}", file=sys.stderr)
            setattr(namespace, self.dest, values)

    dest = new.removeprefix("--").replace("-", "_")
    p.add_argument(old, dest=dest, type=kind, action=Alias, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def write_config(name: str, path: Path, p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--write-config``: write the shipped config of demo ``name`` to ``path`` (``-``: stdout); return the exit
    code. Refuses (2) an existing file, and other options, which a copy of the shipped file would not hold."""
    from rollhub.run.main import shipped_text

    defaults = vars(p.parse_args([]))
    given = sorted(f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                   if k != "write_config" and v != defaults.get(k))  # fmt: skip
    if given:
        print(f"{p.prog}: --write-config writes the shipped config as it is, so it takes no other options (got "
              f"{', '.join(given)}); edit the written file instead", file=sys.stderr)  # fmt: skip
        return 2
    text = shipped_text(name)
    if str(path) == "-":
        sys.stdout.write(text)
        return 0
    if path.exists():
        print(f"{p.prog}: {path} exists; choose another path or remove it first", file=sys.stderr)
        return 2
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote the {name} demo's config to {path}; edit it, then run it with: rollhub run {path}", file=sys.stderr)
    return 0


def overrides(args: argparse.Namespace, options: Mapping[str, Option]) -> list[str]:
    """The ``--set`` assignments the ``options`` (option -> :data:`Option`) given stand for, then the explicit ones."""
    sets = [f"{key}={json.dumps(str(v) if isinstance(v, Path) else v)}" for opt, (key, _, _) in options.items()
            if key is not None and (v := getattr(args, opt)) is not None]  # fmt: skip
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
