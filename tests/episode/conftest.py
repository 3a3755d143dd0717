"""Tokenizers built here (nothing downloads): the tiny model's byte-level BPE with its tool-format chat template and
a SentencePiece-style tokenizer with leading-space pieces."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from rollhub.models.tiny import DEFAULT_CORPUS, train_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """The tiny model's tokenizer (byte-level BPE, ``<bos>`` first, the tool-format chat template)."""
    return train_tokenizer(DEFAULT_CORPUS, 320)


@pytest.fixture(scope="session")
def piece_tokenizer() -> Any:
    """A SentencePiece-style tokenizer: ``▁`` marks a leading space and is prepended to the start of a text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["user: what is 12+34?\nassistant: 46\nuser: ok thanks\nassistant: you are welcome\n"] * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))  # fmt: skip
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}</s>{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=template)  # fmt: skip
