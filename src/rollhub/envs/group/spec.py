"""Load a group environment from a spec: ``"package.module:Class"`` plus constructor arguments.

Specs are strings so they travel in configs, over Ray and in checkpoints; the class is imported only where the
environment runs.
"""

from __future__ import annotations

from typing import Any

from rollhub.envs.group.base import GroupEnv
from rollhub.envs.loading import load_object, missing_methods
from rollhub.errors import ConfigError

#: Short names for the built-in environments.
BUILTIN_SPECS: dict[str, str] = {
    "arithmetic": "rollhub.envs.group.arithmetic:ArithmeticEnv",
    "mock": "rollhub.envs.group.mock:MockEnv",
    "repeat": "rollhub.envs.group.repeat:RepeatEnv",
    "episodes": "rollhub.envs.episode.spec:episode_env",
}


def load_environment_from_spec(spec: str, args: dict[str, Any] | None = None) -> GroupEnv:
    """Import and construct the environment ``spec`` names.

    Args:
        spec: ``"package.module:Class"`` or a built-in short name (``"arithmetic"``, ``"mock"``).
        args: keyword arguments for the class.

    Raises:
        ConfigError: the spec is malformed, cannot be imported, rejects the arguments, or does not build
            an object with ``name`` and ``sample``; the message names what is missing.
    """
    cls = load_object(BUILTIN_SPECS.get(spec, spec))
    try:
        env = cls(**(args or {}))
    except TypeError as exc:
        raise ConfigError(f"environment {spec!r} rejected arguments {args!r}: {exc}") from None
    missing = [f"'{m}'" for m in ("name",) if not hasattr(env, m)] + [
        f"'{m}(...)'" for m in missing_methods(env, ("sample",))
    ]
    if missing and not missing_methods(env, ("tasks", "step", "outcome")):
        raise ConfigError(
            f"{spec!r} built {type(env).__name__}, a multi-turn environment (tasks, step, outcome), not a group "
            "environment; wrap it in rollhub.envs.episode.EpisodeGroupEnv (in rollhub run: keep env.id and add an "
            "[env.episode] table with its budgets)"
        )
    if missing:
        raise ConfigError(
            f"{spec!r} built {type(env).__name__}, which lacks {' and '.join(missing)}; a group environment needs "
            "a name attribute and sample(inference_ctx, n_examples, n_generations, mode, rng)"
        )
    return env
