"""Completion text made where the completion arrives, by the engine's own algorithm: :class:`StreamDecoder`.

An engine that detokenizes does it in its API server, for every request and every step: the output tokens go
through an incremental decoder, and each sampled token's log-prob entry gets its decoded string. On a machine where
the engine shares its cores with the trainer, that work takes CPU from generation (on two cores, about a quarter
of the API server's CPU in a ``bench-partial`` run). A rollout worker needs the text once per completion, so on
the token route (``inference.route = "generate"``) it can ask for token ids only (``output_mode = "tokens"``) and
make the text itself.

The text must be the engine's to the character: environments score it. vLLM's fast detokenizer (the one it uses
for every tokenizer with a ``tokenizer.json``) runs a ``tokenizers`` ``DecodeStream`` primed with the prompt's
token ids and steps it through the output ids, skipping special tokens; the text is what the steps returned,
joined, less the last token when a stop token ended the completion. :meth:`StreamDecoder.text` does exactly that
with the same library over the same ``tokenizer.json``, so a token that completes a character is decoded with the
context before it (the prompt included), and bytes of a character the completion never finished are left out, as
the engine leaves them (``tests/llm/test_detokenize_vllm.py`` compares the two on vLLM's own class). Stop strings
need the engine's own text (it matches them as it decodes), so a request with stop strings is detokenized by the
engine.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from rollhub.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
INVALID_PREFIX = "Invalid prefix encountered"  # the library's error when a stream's text stops being a prefix


class StreamDecoder:
    """Decodes completions as vLLM's fast detokenizer does (see the module docstring); safe to share between
    threads and to pickle (it travels as the ``tokenizer.json`` text and builds its tokenizer where it is used).

    Args:
        tokenizer_json: the text of the model's ``tokenizer.json``.
        skip_special_tokens: leave special tokens out of the text (vLLM's default, which rollhub's requests keep).
    """

    def __init__(self, tokenizer_json: str, skip_special_tokens: bool = True) -> None:
        self.tokenizer_json = tokenizer_json
        self.skip_special_tokens = skip_special_tokens
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._built()  # a bad file fails here, where the decoder is made, not in a rollout worker

    @classmethod
    def for_model(cls, model: str | Path) -> StreamDecoder | None:
        """The decoder of the model directory ``model``, or ``None`` when it has no ``tokenizer.json`` (a model
        named by a hub id, or one with only a slow tokenizer: the engine detokenizes those)."""
        path = Path(model) / TOKENIZER_FILE
        if not path.is_file():
            return None
        try:
            return cls(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"{path} is not a tokenizer the `tokenizers` library reads: {exc}") from exc

    def __getstate__(self) -> dict[str, Any]:
        return {"tokenizer_json": self.tokenizer_json, "skip_special_tokens": self.skip_special_tokens}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tokenizer_json = state["tokenizer_json"]
        self.skip_special_tokens = state["skip_special_tokens"]
        self._tokenizer = None
        self._lock = threading.Lock()

    def _built(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from tokenizers import Tokenizer

                try:
                    self._tokenizer = Tokenizer.from_str(self.tokenizer_json)
                except Exception as exc:  # the library raises its own exception type
                    raise ValueError(str(exc)) from exc
            return self._tokenizer

    def text(self, prompt: list[int] | tuple[int, ...], tokens: list[int] | tuple[int, ...],
             stopped: bool = False) -> str:  # fmt: skip
        """The text of ``tokens`` sampled after ``prompt``, as the engine would have returned it; ``stopped``: a
        stop token (end of sequence, or one of ``stop_token_ids``) ended the completion, and the engine leaves that
        last token out of the text, whatever it decodes to."""
        from tokenizers.decoders import DecodeStream

        tokenizer = self._built()
        stream = DecodeStream(ids=list(prompt), skip_special_tokens=self.skip_special_tokens)
        pieces = []
        for token in tokens[:-1] if stopped else tokens:
            try:
                piece = stream.step(tokenizer, int(token))
            except (OverflowError, TypeError):  # an id the tokenizer cannot hold: the engine's step gives nothing
                piece = None
            except Exception as exc:
                if not str(exc).startswith(INVALID_PREFIX):
                    raise
                # the engine's recovery: a fresh stream, without the context, from this token on
                stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
                piece = stream.step(tokenizer, int(token))
            pieces.append(piece or "")
        return "".join(pieces)
