"""Where ``rollhub run`` finds a user's own environment package without installing it.

``env.id = "mypkg.corridor:Corridor"`` is imported in this process (the pre-flight check) and in every
process that builds environments: worker threads, worker processes, Ray worker actors and their environment
processes. ``rollhub run`` looks for it, after the installed packages, in the directory of the config file and
then in the directory it was started from: :func:`add_user_code_dirs` puts both on ``sys.path`` here and into
``ROLLHUB_USER_PATH`` (:data:`rollhub.envs.loading.USER_PATH_ENV`), which every process started after it
inherits (a Ray runtime the run starts passes it to its workers) and reads when it loads an environment.
``PYTHONPATH`` is left alone: it would put the user's modules ahead of the installed packages in those
processes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rollhub.envs.loading import USER_PATH_ENV


def user_code_dirs(config_file: Path | None, cwd: Path | None = None) -> list[Path]:
    """The directories searched for user code: the config file's, then ``cwd`` (default: the current one)."""
    dirs = [Path(config_file).resolve().parent] if config_file is not None else []
    dirs.append((cwd or Path.cwd()).resolve())
    return list(dict.fromkeys(dirs))


def add_user_code_dirs(config_file: Path | None, cwd: Path | None = None) -> list[str]:
    """Make packages in :func:`user_code_dirs` importable here and in every process started after this call;
    return the directories added."""
    known = [p for p in os.environ.get(USER_PATH_ENV, "").split(os.pathsep) if p]
    added = [d for d in map(str, user_code_dirs(config_file, cwd)) if d not in known]
    if added:
        os.environ[USER_PATH_ENV] = os.pathsep.join([*known, *added])
    for directory in [*known, *added]:
        if directory not in sys.path:
            sys.path.append(directory)
    return added
