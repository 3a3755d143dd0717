"""Hugging Face causal language models and tokenizers: the model layer of the LLM path.

:func:`load_causal_lm` and :func:`load_tokenizer` open any model directory or hub name the way a trainer
does (``from_pretrained``); :func:`build_tiny_model` writes a small random Qwen2 and a byte-level BPE tokenizer
trained on the spot into a directory, so tests, demos and CI exercise that same loading code without a
download. Needs the ``hf`` extra (``transformers``, ``tokenizers``).
"""

from __future__ import annotations

from rollhub.models.hf import ModelError, load_causal_lm, load_tokenizer, logits_of
from rollhub.models.tiny import TinyModelSpec, build_tiny_model

__all__ = ["ModelError", "TinyModelSpec", "build_tiny_model", "load_causal_lm", "load_tokenizer", "logits_of"]
