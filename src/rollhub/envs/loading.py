"""Import what an environment spec names (``"package.module:Name"``), with errors that say what to do.

Both kinds of environment (step and group) name user code the same way, so both load it here: a module that
cannot be found gets the ways to make it importable (``rollhub run`` looks beside the config file and in the
directory it starts in; see :mod:`rollhub.run.user_code`); a module that is found but fails to import says so
instead, since then the package is where it should be and something it imports is not.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from rollhub.errors import ConfigError

USER_PATH_ENV = "ROLLHUB_USER_PATH"
"""Directories (``os.pathsep``-separated) searched for environment packages after the installed ones, in every
process that loads an environment: ``rollhub run`` sets it (see :mod:`rollhub.run.user_code`), and the processes
it starts inherit it. Unlike ``PYTHONPATH`` it never puts a user's module ahead of an installed package."""

MAKE_IMPORTABLE = (
    "make it importable: put the package beside the config file or in the directory you run rollhub from, "
    "install it (pip install -e .), or add the directory that holds it to PYTHONPATH"
)


def _is_the_spec_module(missing: str | None, module_name: str) -> bool:
    """Whether a ``ModuleNotFoundError`` for ``missing`` means ``module_name`` itself (or a parent) is absent."""
    return missing is not None and (module_name == missing or module_name.startswith(missing + "."))


def extend_import_path() -> None:
    """Append the directories of :data:`USER_PATH_ENV` to ``sys.path`` (those not on it yet)."""
    for directory in os.environ.get(USER_PATH_ENV, "").split(os.pathsep):
        if directory and directory not in sys.path:
            sys.path.append(directory)


def load_object(spec: str) -> Any:
    """The object ``spec`` (``"package.module:Name"``) names, imported (looking in :data:`USER_PATH_ENV` too).

    Raises:
        ConfigError: the spec is malformed, its module cannot be found or fails to import, or it has no such
            name; the message names the spec and what to do.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"env spec {spec!r} must look like 'package.module:Class'; fix the spec name")
    extend_import_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if _is_the_spec_module(exc.name, module_name):
            raise ConfigError(
                f"cannot import module {module_name!r} of env spec {spec!r}: {exc}; {MAKE_IMPORTABLE}"
            ) from None
        raise ConfigError(
            f"cannot import module {module_name!r} of env spec {spec!r}: importing it needs {exc.name!r}, which "
            f"is not installed ({exc}); install it"
        ) from None
    except ImportError as exc:
        raise ConfigError(f"cannot import module {module_name!r} of env spec {spec!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(
            f"module {module_name!r} has no {attr!r} (env spec {spec!r}); check the name after the colon"
        ) from None


def missing_methods(obj: Any, names: tuple[str, ...]) -> list[str]:
    """The names in ``names`` that ``obj`` lacks or holds as something that cannot be called."""
    return [name for name in names if not callable(getattr(obj, name, None))]
