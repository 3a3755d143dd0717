"""Opening Hugging Face causal LMs and tokenizers for training, with errors that say what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rollhub.errors import RollhubError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(RollhubError):
    """A model or tokenizer that cannot be opened, or an option the model layer does not know."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelError(
            "Hugging Face models need the 'hf' extra: pip install 'rollhub[hf]' (transformers, tokenizers)"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars would break the run's progress line
    return transformers


def _check_source(path_or_name: str) -> None:
    if path_or_name.startswith((".", "/", "~")) and not Path(path_or_name).expanduser().is_dir():
        raise ModelError(f"model directory {path_or_name!r} does not exist; give a directory or a hub name")


def load_causal_lm(path_or_name: str, dtype: str = "float32") -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path_or_name)`` in ``dtype``, in eval mode.

    Args:
        path_or_name: a local directory (``save_pretrained`` output) or a hub name (downloaded by
            ``transformers`` unless ``HF_HUB_OFFLINE=1``).
        dtype: ``float32``, ``bfloat16`` or ``float16``.

    Raises:
        ModelError: ``dtype`` is unknown, or the model cannot be opened (the cause is in the message).
    """
    if dtype not in _DTYPES:
        raise ModelError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    _check_source(path_or_name)
    transformers = _transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path_or_name, dtype=_DTYPES[dtype])
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot open the causal LM {path_or_name!r}: {exc}") from None
    model.eval()
    return model


def load_tokenizer(path_or_name: str) -> Any:
    """``AutoTokenizer.from_pretrained(path_or_name)``.

    Raises:
        ModelError: the tokenizer cannot be opened, or it has no end-of-sequence token (completions need one).
    """
    _check_source(path_or_name)
    transformers = _transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path_or_name)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot open the tokenizer of {path_or_name!r}: {exc}") from None
    if tokenizer.eos_token_id is None:
        raise ModelError(f"the tokenizer of {path_or_name!r} has no eos_token; set one in its tokenizer_config.json")
    return tokenizer


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model call: a Hugging Face output's ``.logits``, or the tensor itself."""
    return output if isinstance(output, torch.Tensor) else output.logits


def output_head(model: Any) -> tuple[Any, torch.nn.Module] | None:
    """``(hidden_states, head)`` of a causal LM whose logits are exactly ``head(hidden_states(ids))``, so the
    logits can be computed a block of positions at a time; ``None`` when the model does anything after its head
    (logit soft-capping or scaling) or exposes no such split.

    ``hidden_states`` is the built-in transformer's own method, or for a Hugging Face model its decoder's
    ``last_hidden_state``.
    """
    if callable(getattr(model, "hidden_states", None)) and isinstance(getattr(model, "head", None), torch.nn.Module):
        return model.hidden_states, model.head
    config = getattr(model, "config", None)
    if config is None or getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    decoder, head = (get_decoder(), get_head()) if callable(get_decoder) and callable(get_head) else (None, None)
    if decoder is None or not isinstance(head, torch.nn.Linear):
        return None
    return (lambda ids: decoder(input_ids=ids).last_hidden_state), head
