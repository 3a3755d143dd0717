"""Rendering as token deltas: the extension property, a history-rewriting template forking a row, and a
SentencePiece-style tokenizer whose leading-space pieces must not leak into a delta."""

from __future__ import annotations

from typing import Any

from episode_fakes import REWRITING_TEMPLATE

from rollhub.envs.episode.render import ChatRenderer

USER = {"role": "user", "content": "what is 12+34?"}


def sample(renderer: ChatRenderer, text: str) -> list[int]:
    """What an engine samples for ``text``: its ids, then the stop token."""
    tok = renderer.tokenizer
    return [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]


def test_deltas_append_onto_the_sampled_ids_and_rebuild_the_conversation(tiny_tokenizer: Any) -> None:
    r = ChatRenderer(tiny_tokenizer)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"properties": {"a": {}, "b": {}}}}}]
    history: list[dict[str, Any]] = [USER]
    row = r.prompt(history, tools)
    for text, new in [('<tool_call>{"name": "calc", "arguments": {"a": 1}}</tool_call>', {"role": "tool",
                       "content": "46"}), ("46", {"role": "user", "content": "thanks"})]:  # fmt: skip
        ids = sample(r, text)
        row += ids
        history.append({"role": "assistant", "content": text})
        ext = r.extend(history, [new], tools, stop_token=ids[-1])
        assert not ext.forked
        assert tiny_tokenizer.convert_ids_to_tokens(list(ext.ids[:1])) == ["Ċ"]  # "\n" after the sampled <eos>
        row += ext.ids
        history.append(new)
    # the row is the whole conversation's own encoding: nothing missing, nothing doubled at the seams
    assert row == r.encode(r.text(history, tools, True), special=True)


def test_a_template_that_rewrites_history_forks_only_when_it_does(tiny_tokenizer: Any) -> None:
    r = ChatRenderer(tiny_tokenizer, chat_template=REWRITING_TEMPLATE)
    thought = "<think>12+34 is 46</think>46"
    history = [USER, {"role": "assistant", "content": thought}]
    stop = tiny_tokenizer.eos_token_id
    # a tool result comes after the last user message: earlier turns are rendered as they were, no fork
    assert not r.extend(history, [{"role": "tool", "content": "ok"}], stop_token=stop).forked
    # a new user message hides the earlier reasoning: the rendered history changed, so a new row starts
    new = [{"role": "user", "content": "and 1+1?"}]
    ext = r.extend(history, new, stop_token=stop)
    assert ext.forked and "rewrote" in ext.reason
    assert list(ext.ids) == r.prompt([*history, *new])
    assert "think" not in tiny_tokenizer.decode(list(ext.ids))


def test_leading_space_pieces_add_no_spurious_token(piece_tokenizer: Any) -> None:
    tok = piece_tokenizer
    r = ChatRenderer(tok)
    history: list[dict[str, Any]] = [USER]
    row = r.prompt(history)
    ids = sample(r, "46")
    assert tok.convert_ids_to_tokens(ids) == ["▁46", "</s>"]  # the piece the model samples after "assistant:"
    row += ids
    history.append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)})
    new = [{"role": "user", "content": "ok thanks"}]
    ext = r.extend(history, new, stop_token=ids[-1])
    row += ext.ids
    history += new
    assert not ext.forked
    assert row == r.encode(r.text(history, None, True), special=True)
    # encoded alone, the same delta text starts with a "▁" piece that is in no tokenization of the conversation
    alone = tok.convert_ids_to_tokens(r.encode("\nuser: ok thanks\nassistant:"))
    assert alone[0] == "▁" and tok.convert_ids_to_tokens(list(ext.ids))[0] == "\n"


def test_a_stop_token_the_template_does_not_write_still_separates_the_delta() -> None:
    from rollhub.models.tiny import train_tokenizer

    tok = train_tokenizer(["12+=34+=5+=6+=7+=8+=9+=0+="], 16, all_bytes=False)  # "+=" is one token
    assert len(tok("+=", add_special_tokens=False)["input_ids"]) == 1
    r = ChatRenderer(tok, chat_template="{% for m in messages %}{{ m['content'] }}={% endfor %}")
    history = [{"role": "user", "content": "1"}]
    row = r.prompt(history)
    ids = sample(r, "2+")  # the text ends in "+": without the <eos> between, "+" and the template's "=" would merge
    row += ids
    history.append({"role": "assistant", "content": "2+"})
    ext = r.extend(history, [{"role": "tool", "content": "3"}], stop_token=ids[-1])
    assert not ext.forked
    assert tok.convert_ids_to_tokens(list(ext.ids)) == ["=", "3", "="]
