"""Completion text made in the rollout worker (:mod:`rollhub.inference.detokenize`): the engine's algorithm over the
model's ``tokenizer.json`` (context from the prompt, an unfinished character left out, special tokens skipped), and
the token route asking for token ids only when the client makes the text (text still asked for with stop strings).
Against the real engine: ``tests/llm/test_vllm_sampling.py``."""

from __future__ import annotations

import json
import pickle
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rollhub.errors import ConfigError
from rollhub.inference.base import SamplingParams
from rollhub.inference.detokenize import StreamDecoder
from rollhub.inference.openai_client import GENERATE_PATH, OpenAICompletionsClient

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer (every byte in its alphabet, few merges: a 2-byte character is 2 tokens) saved as
    a model directory saves it."""
    from rollhub.models.tiny import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(["hello world 0123456789 ab"], vocab_size=300).save_pretrained(str(out))
    return out


def _ids(directory: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_text_is_the_tokens_text_and_an_unfinished_character_is_left_out(byte_tokenizer: Path) -> None:
    decoder = StreamDecoder.for_model(byte_tokenizer)
    assert decoder is not None
    prompt = _ids(byte_tokenizer, "hello ")
    done = _ids(byte_tokenizer, "world é ü 12")
    assert decoder.text(prompt, done) == "world é ü 12"
    e_acute = _ids(byte_tokenizer, "é")
    assert len(e_acute) == 2  # two byte tokens: the first alone is no character yet
    cut = _ids(byte_tokenizer, "ab") + e_acute[:1]
    assert decoder.text(prompt, cut) == "ab"  # the engine leaves the unfinished byte out (decode() would give "�")
    assert decoder.text(prompt, []) == ""


def test_a_stop_token_that_ended_the_completion_is_left_out_of_its_text(byte_tokenizer: Path) -> None:
    decoder = StreamDecoder.for_model(byte_tokenizer)
    assert decoder is not None
    ids = _ids(byte_tokenizer, "abc")
    assert decoder.text([], ids, stopped=True) == "ab"  # the engine does not decode the token that stopped it
    assert decoder.text([], ids) == "abc"


def test_special_tokens_are_skipped_and_kept_when_asked(byte_tokenizer: Path) -> None:
    text = (byte_tokenizer / "tokenizer.json").read_text()
    eos = next(t["id"] for t in json.loads(text)["added_tokens"] if t["content"] == "<eos>")
    ids = [*_ids(byte_tokenizer, "ab"), eos]
    assert StreamDecoder(text).text([], ids) == "ab"
    assert StreamDecoder(text, skip_special_tokens=False).text([], ids) == "ab<eos>"


def test_the_decoder_pickles_as_its_file_and_decodes_from_many_threads(byte_tokenizer: Path) -> None:
    decoder = StreamDecoder.for_model(byte_tokenizer)
    copy = pickle.loads(pickle.dumps(decoder))
    assert copy.tokenizer_json == decoder.tokenizer_json  # type: ignore[union-attr]
    want = "hello world 0123 é"
    ids = _ids(byte_tokenizer, want)
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(copy.text([], ids))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 8


def test_a_model_without_tokenizer_json_has_no_decoder_and_a_bad_file_is_named(tmp_path: Path) -> None:
    assert StreamDecoder.for_model(tmp_path) is None
    assert StreamDecoder.for_model("Qwen/Qwen2.5-0.5B-Instruct") is None  # a hub id: the engine detokenizes
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer\.json is not a tokenizer"):
        StreamDecoder.for_model(tmp_path)


class Engine:
    """Answers ``/inference/v1/generate`` like vLLM 0.32: text and text log-probs in ``output_mode="text"``, token
    ids only in ``"tokens"``; records every request body."""

    def __init__(self, tokens: list[int], text: str) -> None:
        self.tokens, self.text = tokens, text
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        assert request.url.path == GENERATE_PATH
        text_mode = body["output_mode"] == "text"
        assert body["sampling_params"]["detokenize"] is text_mode  # vLLM refuses text without detokenizing
        choices = []
        for i in range(body["sampling_params"]["n"]):
            content = [{"token_id": t, "logprob": -0.5, "top_logprobs": []} for t in self.tokens]
            if text_mode:
                content = [{"token": f"t{t}", "logprob": -0.5, "bytes": None, "top_logprobs": []} for t in self.tokens]
            choice = {"index": i, "token_ids": self.tokens, "finish_reason": "length", "logprobs": {"content": content}}
            choices.append({**choice, "text": self.text} if text_mode else choice)
        return httpx.Response(200, json={"choices": choices})


def test_the_token_route_asks_for_ids_only_when_the_client_makes_the_text(byte_tokenizer: Path) -> None:
    decoder = StreamDecoder.for_model(byte_tokenizer)
    tokens = _ids(byte_tokenizer, "world")
    engine = Engine(tokens, "the engine's text")
    client = OpenAICompletionsClient("http://engine", "tiny", send_seed=False, max_retries=0, route="generate",
                                     transport=httpx.MockTransport(engine), decoder=decoder)  # fmt: skip
    params = SamplingParams(max_tokens=5, temperature=1.0)
    [[a, b]] = client.complete([_ids(byte_tokenizer, "hello ")], 2, params, np.random.default_rng(0))
    assert engine.bodies[-1]["output_mode"] == "tokens" and engine.bodies[-1]["sampling_params"]["detokenize"] is False
    assert a.text == b.text == "world" and a.logprobs == (-0.5,) * len(tokens)
    with_stop = SamplingParams(max_tokens=5, temperature=1.0, stop=("\n",))
    [[c]] = client.complete([[1, 2]], 1, with_stop, np.random.default_rng(0))
    assert engine.bodies[-1]["output_mode"] == "text" and c.text == "the engine's text"  # the engine matches stops
    plain = OpenAICompletionsClient("http://engine", "tiny", send_seed=False, max_retries=0, route="generate",
                                    transport=httpx.MockTransport(engine))  # fmt: skip
    [[d]] = plain.complete([[1, 2]], 1, params, np.random.default_rng(0))
    assert engine.bodies[-1]["output_mode"] == "text" and d.text == "the engine's text"
