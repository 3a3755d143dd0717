"""Chat-template rendering as token deltas: the environment's messages appended onto the engine's own ids.

A model turn's tokens are the engine's (what it was prompted with and what it sampled); they are never
re-tokenized. What the environment adds between two model turns (the end of the assistant turn the model did not
sample, tool results, user messages, the next generation prompt) is rendered by the model's chat template and
appended to the ids as a *delta*:

1. Render the conversation without the new messages (it ends with the assistant turn) and with them (plus the
   generation prompt). The template must only append (the *extension property*): the second text starts with the
   first. A template that rewrites earlier turns when later ones arrive (Qwen3 drops earlier reasoning once a new
   user message comes) breaks it: :meth:`ChatRenderer.extend` then returns a *fork*, the whole new conversation
   rendered from scratch, which starts a new token row.
2. The delta text is the part of the assistant turn's closing the engine did not sample (e.g. the ``\\n`` after
   ``<|im_end|>``; the stop token itself was sampled and is in the ids) followed by the suffix of step 1. A
   template that does not write the stop token at all still finds it in the row: the delta follows it.
3. The delta is tokenized *in context*: the conversation text up to the delta (the stop token included) and the
   text including it are both encoded, and the delta's ids are the tail by which the second extends the first. A
   piece tokenizer that adds a leading-space piece at the start of a text (SentencePiece) would put a spurious
   token in front of a delta encoded alone; in context there is no start of text. When the two encodings disagree
   on the shared prefix (a token that spans the boundary), the delta cannot be appended exactly: a fork.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rollhub.errors import RollhubError

Message = Mapping[str, Any]
_SENTINEL = "\x00rollhub-turn-end\x00"


class RenderError(RollhubError):
    """The chat template could not render a conversation (or renders an assistant turn in a way this cannot
    locate)."""


class ChatTokenizer(Protocol):
    """What rendering needs of a Hugging Face tokenizer (``PreTrainedTokenizerFast`` has all of it)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str: ...


@dataclass(frozen=True, slots=True)
class Extension:
    """What the new messages add to a token row.

    Attributes:
        ids: the delta to append (``forked`` False), or the whole new conversation (``forked`` True).
        forked: the template rewrote earlier turns or the delta did not tokenize exactly: ``ids`` start a new row.
        reason: why it forked (empty when it did not).
    """

    ids: tuple[int, ...]
    forked: bool = False
    reason: str = ""


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template, as the first prompt or as deltas.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        chat_template: a template to use instead of the tokenizer's own.
        add_special_tokens: whether the first prompt is encoded with the tokenizer's special tokens (``<bos>``);
            the default matches how an engine encodes a text prompt on ``/v1/completions``.
    """

    def __init__(self, tokenizer: ChatTokenizer, chat_template: str | None = None,
                 add_special_tokens: bool = True) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.add_special_tokens = add_special_tokens

    def text(self, messages: Sequence[Message], tools: Sequence[Message] | None, generation_prompt: bool) -> str:
        """The template's rendering of ``messages`` (with the generation prompt when asked)."""
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
        if tools:
            kwargs["tools"] = [dict(t) for t in tools]
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        try:
            out = self.tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
        except Exception as exc:  # jinja raises its own error types; name what failed
            raise RenderError(f"the chat template failed on {len(messages)} messages: {exc}") from exc
        return str(out)

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens only when ``special``)."""
        return [int(i) for i in self.tokenizer(text, add_special_tokens=special)["input_ids"]]

    def prompt(self, messages: Sequence[Message], tools: Sequence[Message] | None = None) -> list[int]:
        """The ids of a conversation rendered from scratch, ending in the generation prompt (a row's start)."""
        return self.encode(self.text(messages, tools, True), self.add_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one id, special tokens as written (``<|im_end|>``)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def assistant_close(self, history: Sequence[Message], tools: Sequence[Message] | None) -> str:
        """What the template writes after the content of the last (assistant) message of ``history``."""
        if not history or history[-1].get("role") != "assistant":
            return ""
        probe = [*history[:-1], {"role": "assistant", "content": _SENTINEL}]
        text = self.text(probe, tools, False)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise RenderError("the chat template drops the content of the last assistant message")
        return text[at + len(_SENTINEL) :]

    def extend(self, history: Sequence[Message], new: Sequence[Message], tools: Sequence[Message] | None = None,
               stop_token: int | None = None) -> Extension:  # fmt: skip
        """The ids that carry a row from the end of ``history`` to the generation prompt after ``new``.

        Args:
            history: the conversation the row holds so far; when it ends with an assistant message, the row ends
                with that turn's sampled ids.
            new: the messages to add (tool results, user messages).
            tools: the tools the template lists.
            stop_token: the id that ended the last sampled turn (it is in the row: the template's closing
                after it is all that is still missing); ``None`` when the turn did not end on a stop token.
        """
        without = self.text(history, tools, False)
        full = [*history, *new]
        with_new = self.text(full, tools, True)
        if not with_new.startswith(without):
            return Extension(tuple(self.prompt(full, tools)), True, "the chat template rewrote earlier turns")
        close = self.assistant_close(history, tools)
        if not without.endswith(close):
            return Extension(tuple(self.prompt(full, tools)), True, "the assistant turn's closing moved")
        missing, unrendered = close, ""
        if stop_token is not None:
            stop = self.token_text(stop_token)
            if close.startswith(stop):
                missing = close[len(stop) :]
            else:  # the row holds a stop token the template does not write: the delta follows it, not the text
                unrendered = stop
        context = without[: len(without) - len(missing)] + unrendered
        before, after = self.encode(context), self.encode(context + with_new[len(without) - len(missing) :])
        if after[: len(before)] != before:
            return Extension(tuple(self.prompt(full, tools)), True, "a token spans the end of the assistant turn")
        return Extension(tuple(after[len(before) :]))
