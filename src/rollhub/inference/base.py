"""What an environment needs from a policy: sampled completions with their token ids and log-probs.

An :class:`InferenceContext` hides where the policy runs (a local torch module, a vLLM or SGLang server
behind the OpenAI completions API). Environments only see :class:`Completion` values, so the same
environment code produces training data from either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How completions are drawn.

    Attributes:
        max_tokens: most completion tokens per sample (the stop token included).
        temperature: softmax temperature; 0 means greedy.
        stop_eos: stop a sample when the policy emits its end-of-sequence token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    stop_eos: bool = True


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
    """

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: FinishReason


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
