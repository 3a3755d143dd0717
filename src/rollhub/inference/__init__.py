"""Policies behind one protocol: local torch models for CPU runs and OpenAI-compatible servers (vLLM, SGLang),
and :mod:`rollhub.inference.engine`, a managed vLLM engine process."""

from __future__ import annotations

from rollhub.inference.base import Completion, InferenceContext, SamplingParams
from rollhub.inference.tokenizer import CharTokenizer, TokenizerError

__all__ = ["CharTokenizer", "Completion", "InferenceContext", "SamplingParams", "TokenizerError"]
