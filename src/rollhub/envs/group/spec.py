"""Load a group environment from a spec: ``"package.module:Class"`` plus constructor arguments.

Specs are strings so they travel in configs, over Ray and in checkpoints; the class is imported only where the
environment runs.
"""

from __future__ import annotations

import importlib
from typing import Any

from rollhub.envs.group.base import GroupEnv
from rollhub.errors import ConfigError

#: Short names for the built-in environments.
BUILTIN_SPECS: dict[str, str] = {
    "arithmetic": "rollhub.envs.group.arithmetic:ArithmeticEnv",
    "mock": "rollhub.envs.group.mock:MockEnv",
    "episodes": "rollhub.envs.episode.spec:episode_env",
}


def import_target(target: str, spec: str | None = None) -> Any:
    """The object ``"package.module:attr"`` names.

    Raises:
        ConfigError: the target is malformed or cannot be imported (the message names ``spec``, default ``target``).
    """
    spec = spec or target
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"environment spec {spec!r} must look like 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} of environment spec {spec!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no {attr!r} (environment spec {spec!r})") from None


def load_environment_from_spec(spec: str, args: dict[str, Any] | None = None) -> GroupEnv:
    """Import and construct the environment ``spec`` names.

    Args:
        spec: ``"package.module:Class"`` or a built-in short name (``"arithmetic"``, ``"mock"``).
        args: keyword arguments for the class.

    Raises:
        ConfigError: the spec is malformed, cannot be imported, rejects the arguments, or does not build
            an object with ``name`` and ``sample``.
    """
    cls = import_target(BUILTIN_SPECS.get(spec, spec), spec)
    try:
        env = cls(**(args or {}))
    except TypeError as exc:
        raise ConfigError(f"environment {spec!r} rejected arguments {args!r}: {exc}") from None
    if not isinstance(env, GroupEnv):
        raise ConfigError(f"{spec!r} built {type(env).__name__}, which lacks 'name' and 'sample(...)'")
    return env
