"""Where ``rollhub run`` finds a user's own environment package without installing it.

``env.id = "mypkg.corridor:Corridor"`` is imported in this process (the pre-flight check) and in every
process that builds environments: worker threads, worker processes, Ray worker actors and their environment
processes. ``rollhub run`` looks for it, after the installed packages, in the directory of the config file and
then in the directory it was started from: :func:`add_user_code_dirs` puts both on ``sys.path`` here and
appends them to ``PYTHONPATH`` for every process started after it (Python children read it, and a Ray
runtime started by the run passes it to its workers).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def user_code_dirs(config_file: Path | None, cwd: Path | None = None) -> list[Path]:
    """The directories searched for user code: the config file's, then ``cwd`` (default: the current one)."""
    dirs = [Path(config_file).resolve().parent] if config_file is not None else []
    dirs.append((cwd or Path.cwd()).resolve())
    return list(dict.fromkeys(dirs))


def add_user_code_dirs(config_file: Path | None, cwd: Path | None = None) -> list[str]:
    """Make packages in :func:`user_code_dirs` importable here and in every child process; return the
    directories added (those already on ``sys.path`` or ``PYTHONPATH`` stay where they are)."""
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    added = []
    for directory in map(str, user_code_dirs(config_file, cwd)):
        if directory not in sys.path:
            sys.path.append(directory)
        if directory not in python_path:
            python_path.append(directory)
            added.append(directory)
    if python_path:
        os.environ["PYTHONPATH"] = os.pathsep.join(python_path)
    return added
