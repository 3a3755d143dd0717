"""A multi-turn environment as a run's ``[env]``: the built-in spec ``"episodes"``.

``rollhub run`` builds this spec from ``[env.episode]`` (``env.id`` the episode environment, ``env.kwargs`` its
arguments, the tokenizer the policy's model unless ``env.episode.tokenizer`` names another); it can also be named
directly:

``[env] id = "episodes"`` builds an :class:`~rollhub.envs.episode.runner.EpisodeGroupEnv` around the
:class:`~rollhub.envs.episode.base.EpisodeEnv` its ``env`` names, rendering with the chat template of the tokenizer
at ``tokenizer`` (the policy's model directory or hub name)::

    [env]
    kind = "group"
    id = "episodes"
    group_size = 8
    kwargs = { env = "my_tools:CalculatorEnv", tokenizer = "/models/qwen2.5-0.5b-instruct", max_tokens = 1024,
               turn_max_tokens = 256, max_turns = 4, env_kwargs = { hi = 20 } }
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollhub.envs.episode.base import EpisodeEnv
from rollhub.envs.episode.render import ChatRenderer
from rollhub.envs.episode.runner import EpisodeGroupEnv
from rollhub.envs.episode.types import EpisodeLimits
from rollhub.envs.loading import load_object
from rollhub.errors import ConfigError

BUILTIN_EPISODE_ENVS = {"calculator": "rollhub.envs.episode.calculator:CalculatorEnv"}


def build_episode_env(env: str, env_kwargs: Mapping[str, Any] | None = None) -> EpisodeEnv:
    """The :class:`EpisodeEnv` ``env`` names (``"package.module:Class"`` or a key of :data:`BUILTIN_EPISODE_ENVS`),
    built with ``env_kwargs``.

    Raises:
        ConfigError: ``env`` cannot be imported or built, or builds no :class:`EpisodeEnv`.
    """
    cls = load_object(BUILTIN_EPISODE_ENVS.get(env, env))
    try:
        inner = cls(**dict(env_kwargs or {}))
    except TypeError as exc:
        raise ConfigError(f"episode environment {env!r} rejected arguments {env_kwargs!r}: {exc}") from None
    if not isinstance(inner, EpisodeEnv):
        raise ConfigError(f"{env!r} built {type(inner).__name__}, which lacks name, tasks, step and outcome")
    return inner


def episode_env(env: str, tokenizer: str, max_tokens: int = 1024, turn_max_tokens: int = 256, max_turns: int = 8,
                discount: float = 1.0, env_kwargs: Mapping[str, Any] | None = None) -> EpisodeGroupEnv:  # fmt: skip
    """The :class:`EpisodeGroupEnv` of ``env`` (``"package.module:Class"`` or ``"calculator"``) built with
    ``env_kwargs``, rendered with ``tokenizer``'s chat template, within the given limits.

    Raises:
        ConfigError: ``env`` cannot be imported or built, or builds no :class:`EpisodeEnv`; a limit is out of range.
    """
    from rollhub.models.hf import load_tokenizer

    inner = build_episode_env(env, env_kwargs)
    limits = EpisodeLimits(max_tokens, turn_max_tokens, max_turns, discount)
    return EpisodeGroupEnv(inner, ChatRenderer(load_tokenizer(tokenizer)), limits)
