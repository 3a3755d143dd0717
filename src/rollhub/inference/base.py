"""What an environment needs from a policy: sampled completions with their token ids and log-probs, or for step
environments the actions, log-probs and values of one batched forward pass.

An :class:`InferenceContext` hides where the policy runs (a local torch module, a vLLM or SGLang server
behind the OpenAI completions API). Environments only see :class:`Completion` values, so the same
environment code produces training data from either. A step policy (``rollhub.rollout.protocols.StepPolicy``,
such as :class:`rollhub.inference.mlp_policy.MLPStepPolicy`) answers each batch of observations with a
:class:`PolicyStep`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How completions are drawn. Every field is sent to an engine explicitly, so nothing is filled in from a
    model's ``generation_config.json``.

    Attributes:
        max_tokens: most completion tokens per sample (the stop token included).
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus mass kept (1: off).
        top_k: most likely tokens kept (0: off).
        min_p: tokens below this share of the top probability are dropped (0: off).
        repetition_penalty, presence_penalty, frequency_penalty: history-dependent penalties (1, 0, 0: off).
            A run refuses other values for training samples, since the trainer does not reproduce them.
        stop: strings that end a completion (the end-of-sequence token is separate: ``stop_eos``).
        stop_eos: stop a sample when the policy emits its end-of-sequence token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_eos: bool = True

    @property
    def greedy(self) -> bool:
        """Whether this is greedy decoding (temperature 0)."""
        return self.temperature <= 0

    def generation_params(self) -> dict[str, Any]:
        """The distribution-shaping fields, as a group's ``generation_params`` records them."""
        return {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "max_tokens": self.max_tokens,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled completion of one prompt.

    Attributes:
        prompt_tokens: token ids of the prompt exactly as the policy saw it (``<bos>`` included if used).
        tokens: the sampled completion token ids (the end-of-sequence token included when it was sampled).
        logprobs: the behaviour log-probability of each completion token, one per token.
        text: the completion decoded to text, special tokens dropped.
        finish_reason: ``"stop"`` when the end-of-sequence token ended it, ``"length"`` at ``max_tokens``,
            ``"abort"`` when the request ended any other way (aborted, an error, an unknown reason).
        params: the settings it was sampled with (``None``: not recorded by the policy).
        versions: the policy version of the weights that sampled each completion token, when the engine reports
            it (``None``: not known per token; the completion then counts as sampled by the version its worker
            had loaded). A completion continued across a weight push holds two or more versions, oldest first.
    """

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: FinishReason
    params: SamplingParams | None = None
    versions: tuple[int, ...] | None = None


@runtime_checkable
class InferenceContext(Protocol):
    """A policy that samples completions for text prompts."""

    def complete(
        self, prompts: list[str], n: int, params: SamplingParams, rng: np.random.Generator
    ) -> list[list[Completion]]:
        """Sample ``n`` completions of every prompt.

        Returns:
            one list of ``n`` completions per prompt, in prompt order.
        """
        ...


@runtime_checkable
class WeightLoading(Protocol):
    """A policy that swaps its weights in place (a local model; a remote engine reloads its own)."""

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        """Take ``weights`` (a state dict of tensors or arrays) as the policy's own."""
        ...


@runtime_checkable
class Closeable(Protocol):
    """A policy that holds something to release (connections, a process)."""

    def close(self) -> None:
        """Release it."""
        ...


@dataclass(frozen=True)
class PolicyStep:
    """The output of one batched forward pass over ``B`` observations.

    Attributes:
        actions: ``[B, ...]`` actions sampled from the policy.
        logp: float32 ``[B]`` log-probabilities of ``actions``.
        values: float32 ``[B]`` value estimates of the observations.
        state: the recurrent state after the step, ``[B, ...]``, or ``None`` for feed-forward policies.
    """

    actions: np.ndarray
    logp: np.ndarray
    values: np.ndarray
    state: np.ndarray | None = None
