"""The rollout worker's text (:class:`~rollhub.inference.detokenize.StreamDecoder`) against vLLM's own fast
detokenizer, run in the engine's interpreter on the same ``tokenizer.json``: random prompts and completions over a
byte-level vocabulary (characters split across tokens, cut short, begun in the prompt; special tokens; completions a
stop token ended, fed a few tokens per step as the engine feeds them) give the same text to the character."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from rollhub.inference.detokenize import StreamDecoder

pytest.importorskip("transformers")

ENGINE_SIDE = """
import json, sys
from types import SimpleNamespace
import tokenizers
from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer
given = json.loads(sys.stdin.read())
tokenizer = SimpleNamespace(_tokenizer=tokenizers.Tokenizer.from_file(given["tokenizer"]))
out = []
for prompt, tokens, stopped, per_step in given["cases"]:
    params = SimpleNamespace(stop=None, min_tokens=0, include_stop_str_in_output=False, skip_special_tokens=True,
                             spaces_between_special_tokens=True)
    detok = FastIncrementalDetokenizer(tokenizer, SimpleNamespace(sampling_params=params, prompt_token_ids=prompt,
                                                                  request_id="r"))
    for i in range(0, len(tokens), per_step):
        detok.update(tokens[i:i + per_step], stopped and i + per_step >= len(tokens))
    out.append(detok.get_next_output_text(True, False))
print(json.dumps(out))
"""


def test_the_workers_text_is_vllms_to_the_character(vllm_python: str, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from rollhub.models.tiny import train_tokenizer

    train_tokenizer(["hello world 0123456789 ab+= ñé"], vocab_size=300).save_pretrained(str(tmp_path))
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    words = ["é", "ü", "日本", "hello", " world", "12+3=", "\n", "€"]
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:  # random ids (byte tokens, merges, specials) mixed with whole words' pieces
        out: list[int] = []
        while len(out) < n:
            if rng.random() < 0.5:
                out.append(int(rng.integers(vocab)))
            else:
                word = tokenizer.encode(words[rng.integers(len(words))], add_special_tokens=False).ids
                out += word[: int(rng.integers(1, len(word) + 1))]  # sometimes a character cut short
        return out[:n]

    cases = [[ids(int(rng.integers(1, 8))), ids(int(rng.integers(0, 24))), bool(rng.random() < 0.3),
              int(rng.integers(1, 5))] for _ in range(300)]  # fmt: skip
    given = json.dumps({"tokenizer": str(tmp_path / "tokenizer.json"), "cases": cases})
    done = subprocess.run([vllm_python, "-c", ENGINE_SIDE], input=given, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    engine = json.loads(done.stdout.strip().splitlines()[-1])
    decoder = StreamDecoder.for_model(tmp_path)
    assert decoder is not None
    ours = [decoder.text(prompt, tokens, stopped=stopped) for prompt, tokens, stopped, _ in cases]
    differ = [(case, e, o) for case, e, o in zip(cases, engine, ours, strict=True) if e != o]
    assert not differ, f"{len(differ)} of {len(cases)} differ, first: {differ[0]}"
    assert sum(e != "" for e in engine) > 250  # the cases are texts, not nothing
    assert sum(any(c in e for c in "éü日€") for e in engine) > 50  # with characters of more than one byte


@pytest.mark.vllm
def test_the_engine_asked_for_ids_only_gives_the_tokens_whose_text_it_would_have_given(
    digits_engine: object, digits_model_dir: Path
) -> None:
    """On the real engine's token route: greedy completions asked with text and asked for ids only (the worker
    making the text) are the same tokens, log-probs and text."""
    from rollhub.inference.base import SamplingParams
    from rollhub.inference.openai_client import OpenAICompletionsClient

    url = digits_engine.url  # type: ignore[attr-defined]
    decoder = StreamDecoder.for_model(digits_model_dir)
    assert decoder is not None
    prompts = [[1, 5, 6, 7], [1, 9, 9], [1, 3, 12, 4, 13]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    rows = {}
    for name, given in (("engine", None), ("worker", decoder)):
        client = OpenAICompletionsClient(url, str(digits_model_dir), send_seed=False, route="generate", decoder=given)
        try:
            rows[name] = [c for row in client.complete(prompts, 1, params, np.random.default_rng(0)) for c in row]
        finally:
            client.close()
    for by_engine, by_worker in zip(rows["engine"], rows["worker"], strict=True):
        assert by_worker.tokens == by_engine.tokens and by_worker.finish_reason == by_engine.finish_reason
        assert by_worker.logprobs == pytest.approx(by_engine.logprobs, abs=1e-5)
        assert by_worker.text == by_engine.text
    assert any(c.text for c in rows["engine"])
