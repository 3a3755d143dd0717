"""The step-environment protocol and the one factory that builds step environments from a spec.

A step environment follows the gymnasium API: ``reset(seed=...) -> (obs, info)`` and
``step(action) -> (obs, reward, terminated, truncated, info)``. ``terminated`` means the MDP reached a
terminal state (no value after it); ``truncated`` means the episode was cut (time limit, crash) and the value
of the last observation still counts. rollhub keeps the two apart everywhere.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rollhub.errors import ConfigError


@runtime_checkable
class StepEnv(Protocol):
    """An environment stepped one action at a time (the gymnasium ``Env`` API)."""

    def reset(self, *, seed: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Start a new episode and return its first observation and an info dict."""
        ...

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Apply ``action``; return ``(obs, reward, terminated, truncated, info)``."""
        ...

    def close(self) -> None:
        """Release the environment's resources."""
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


def _load_object(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"env spec {path!r} is not of the form 'package.module:Class'; fix the spec name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"cannot import module {module_name!r} of env spec {path!r}: {exc}; check that it is installed"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r} (env spec {path!r})") from exc


def make_step_env(spec: EnvSpec) -> StepEnv:
    """Build one environment instance from ``spec``.

    Raises:
        ConfigError: the spec names nothing that can be built; the message says which form was tried.
    """
    if ":" in spec.name:
        return _load_object(spec.name)(**spec.kwargs)
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
