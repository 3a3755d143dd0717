"""The run's sampling settings laid over whatever an environment asks for.

:class:`SamplingOverride` wraps an :class:`~rollhub.inference.base.InferenceContext`: every sampled request
(temperature above 0) is drawn with the run's ``[sampling]`` keys in place of the environment's; greedy requests
(evaluation) pass unchanged. Each completion records the settings it was actually drawn with
(:attr:`~rollhub.inference.base.Completion.params`), so the groups, and the trainer reading them, know the
distribution whoever chose it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

import numpy as np

from rollhub.errors import ConfigError
from rollhub.inference.base import Completion, InferenceContext, SamplingParams

_FIELDS = {f.name for f in fields(SamplingParams)}


class SamplingOverride:
    """An :class:`~rollhub.inference.base.InferenceContext` that samples with ``overrides`` laid over each
    non-greedy request's settings; every other attribute is the wrapped context's.

    Args:
        inner: the policy.
        overrides: :class:`~rollhub.inference.base.SamplingParams` fields (``[sampling]``'s given keys).

    Raises:
        ConfigError: a key is not a sampling setting.
    """

    def __init__(self, inner: InferenceContext, overrides: Mapping[str, Any]) -> None:
        unknown = sorted(set(overrides) - _FIELDS)
        if unknown:
            raise ConfigError(f"sampling keys {unknown} are not sampling settings; use {sorted(_FIELDS)}")
        self.inner = inner
        self.overrides = dict(overrides)

    def complete(
        self, prompts: list[str], n: int, params: SamplingParams, rng: np.random.Generator
    ) -> list[list[Completion]]:
        """Sample through the wrapped policy, with the overrides when ``params`` is not greedy."""
        if not params.greedy and self.overrides:
            params = replace(params, **self.overrides)
        return self.inner.complete(prompts, n, params, rng)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def unwrapped(policy: InferenceContext) -> InferenceContext:
    """The policy under any :class:`SamplingOverride` around it (whose other capabilities are the policy's)."""
    while isinstance(policy, SamplingOverride):
        policy = policy.inner
    return policy


def with_sampling(policy: InferenceContext, sampling: Mapping[str, Any]) -> InferenceContext:
    """``policy`` sampling with ``sampling`` laid over its training requests (itself when none are given)."""
    return SamplingOverride(policy, sampling) if sampling else policy
