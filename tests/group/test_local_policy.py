from __future__ import annotations

import numpy as np
import pytest
import torch

from rollhub.inference.base import SamplingParams
from rollhub.inference.tokenizer import CharTokenizer, TokenizerError
from rollhub.inference.torch_policy import LocalPolicy, PolicyError, TinyTransformer, TransformerConfig


def test_tokenizer_round_trip_and_errors(tokenizer: CharTokenizer) -> None:
    ids = tokenizer.encode("12+7=", bos=True)
    assert ids[0] == tokenizer.bos_id and tokenizer.decode(ids) == "12+7="
    assert tokenizer.decode([*ids, tokenizer.eos_id], skip_special=False) == "<bos>12+7=<eos>"
    with pytest.raises(TokenizerError, match="'x'"):
        tokenizer.encode("1x")
    with pytest.raises(TokenizerError, match="repeats"):
        CharTokenizer("aa")


def test_completions_have_the_promised_shape(policy: LocalPolicy) -> None:
    params = SamplingParams(max_tokens=5, temperature=1.0)
    out = policy.complete(["1+2=", "13+4=", "5="], 3, params, np.random.default_rng(0))
    assert [len(x) for x in out] == [3, 3, 3]
    for prompt, comps in zip(["1+2=", "13+4=", "5="], out, strict=True):
        for c in comps:
            assert c.prompt_tokens == tuple(policy.tokenizer.encode(prompt, bos=True))
            assert 1 <= len(c.tokens) <= 5 and len(c.logprobs) == len(c.tokens)
            assert all(lp <= 0 for lp in c.logprobs)
            eos = policy.tokenizer.eos_id
            assert (c.finish_reason == "stop") == (c.tokens[-1] == eos) and eos not in c.tokens[:-1]


def test_greedy_is_deterministic_and_seeds_reproduce(policy: LocalPolicy) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    a = policy.complete(["2+2="], 2, greedy, np.random.default_rng(0))[0]
    b = policy.complete(["2+2="], 1, greedy, np.random.default_rng(9))[0]
    assert a[0].tokens == a[1].tokens == b[0].tokens
    hot = SamplingParams(max_tokens=4, temperature=1.0)
    assert policy.complete(["2+2="], 4, hot, np.random.default_rng(5)) == policy.complete(
        ["2+2="], 4, hot, np.random.default_rng(5)
    )


def test_weights_of_the_wrong_shape_are_refused(policy: LocalPolicy, tokenizer: CharTokenizer) -> None:
    other = TinyTransformer(TransformerConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2, max_len=16))
    with pytest.raises(PolicyError, match="do not fit"):
        policy.load_weights(other.state_dict())
    policy.load_weights({k: v.numpy() for k, v in policy.model.state_dict().items()})  # numpy is accepted
    with pytest.raises(PolicyError, match="max_len"):
        policy.model(torch.zeros(1, 17, dtype=torch.long))
