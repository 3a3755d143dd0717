from __future__ import annotations

import numpy as np
import pytest
import torch
from group_helpers import mock_curriculum

from rollhub.inference.tokenizer import CharTokenizer
from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer, TransformerConfig

torch.set_num_threads(1)


@pytest.fixture
def tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture
def policy(tokenizer: CharTokenizer) -> LocalPolicy:
    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=2, max_len=16))
    model.eval()
    return LocalPolicy(model, tokenizer)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture
def make_config():
    return mock_curriculum
