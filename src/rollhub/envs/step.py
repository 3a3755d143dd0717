"""The step-environment protocol and the one factory that builds step environments from a spec.

A step environment follows the gymnasium API: ``reset(seed=...) -> (obs, info)`` and
``step(action) -> (obs, reward, terminated, truncated, info)``. ``terminated`` means the MDP reached a
terminal state (no value after it); ``truncated`` means the episode was cut (time limit, crash) and the value
of the last observation still counts. rollhub keeps the two apart everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rollhub.envs.loading import load_object, missing_methods
from rollhub.errors import ConfigError


@runtime_checkable
class StepEnv(Protocol):
    """An environment stepped one action at a time (the gymnasium ``Env`` API).

    ``reset`` and ``step`` are required; ``close()``, when the environment has one, is called once it is done
    with (see :func:`close_env`).
    """

    def reset(self, *, seed: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Start a new episode and return its first observation and an info dict."""
        ...

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Apply ``action``; return ``(obs, reward, terminated, truncated, info)``."""
        ...


@dataclass(frozen=True)
class EnvSpec:
    """A picklable recipe for a step environment, so another process can build its own instance.

    Attributes:
        name: one of three forms, resolved in this order: ``"package.module:Class"`` (any importable
            callable returning a :class:`StepEnv`), a rollhub built-in name (see
            :data:`rollhub.envs.builtin.BUILTIN_ENVS`), or a gymnasium id such as ``"CartPole-v1"``.
        kwargs: keyword arguments for the constructor (or for ``gymnasium.make``).
        task: the label episode statistics are grouped by; defaults to ``name``.
    """

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    task: str | None = None

    @property
    def task_name(self) -> str:
        """The statistics label of this environment."""
        return self.task or self.name


REQUIRED_METHODS = ("reset", "step")
"""What a step environment must have; ``close()`` is optional (called when present)."""


def check_step_env(env: Any, name: str) -> Any:
    """``env`` if it has every method of :data:`REQUIRED_METHODS`.

    Raises:
        ConfigError: a required method is missing; the message names it.
    """
    missing = missing_methods(env, REQUIRED_METHODS)
    if missing:
        methods = " and ".join(f"{m}()" for m in missing)
        raise ConfigError(
            f"env {name!r} built {type(env).__name__}, which has no {methods} method; a step environment needs "
            "reset(*, seed=None) -> (obs, info) and step(action) -> (obs, reward, terminated, truncated, info) "
            "(close() is optional)"
        )
    return env


def close_env(env: Any) -> None:
    """Call ``env.close()`` if the environment has one (it is optional)."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


def make_step_env(spec: EnvSpec) -> StepEnv:
    """Build one environment instance from ``spec``.

    Raises:
        ConfigError: the spec names nothing that can be built, or it builds an object without ``reset`` or
            ``step``; the message says which form was tried.
    """
    if ":" in spec.name:
        return check_step_env(load_object(spec.name)(**spec.kwargs), spec.name)
    from rollhub.envs.builtin import BUILTIN_ENVS

    if spec.name in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec.name](**spec.kwargs)
    try:
        import gymnasium
    except ImportError as exc:
        raise ConfigError(
            f"env {spec.name!r} is not a rollhub built-in and gymnasium is not installed; "
            "install rollhub[ray] or name a 'package.module:Class'"
        ) from exc
    try:
        return gymnasium.make(spec.name, **spec.kwargs)
    except gymnasium.error.Error as exc:
        raise ConfigError(
            f"env {spec.name!r} is neither a rollhub built-in ({sorted(BUILTIN_ENVS)}) nor a gymnasium id: {exc}"
        ) from exc
