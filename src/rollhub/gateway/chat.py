"""OpenAI chat shapes: messages as an agent sends them, as the chat template renders them, and the answers.

An agent sends back the conversation it was given, in the OpenAI form: the gateway's own assistant message (content
without the tool-call text, ``tool_calls`` with ``arguments`` as a JSON string), often with extra ``None`` fields an
SDK adds. :func:`same_message` compares two messages by what they say (role, text, the calls' names and decoded
arguments, tool-call ids and names), so the conversation the agent sends can be matched against the one recorded.
:func:`template_message` is what the chat template is given: plain string content (text parts joined).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from rollhub.envs.episode.tools import ToolCall, parse_tool_calls
from rollhub.inference.base import Completion

Message = Mapping[str, Any]


def text_of(content: Any) -> str:
    """A message's content as text: a string as it is, a list of parts as their ``text`` joined, None as ``""``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def _calls(message: Message) -> tuple[tuple[str, str], ...]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append((str(fn.get("name")), json.dumps(args, sort_keys=True)))
    return tuple(out)


def message_key(message: Message) -> tuple[Any, ...]:
    """What a message says, for comparing the agent's copy with the recorded one."""
    role = message.get("role")
    if role == "assistant":
        return (role, text_of(message.get("content")).strip(), _calls(message))
    return (role, text_of(message.get("content")), message.get("name"), message.get("tool_call_id"))


def same_message(a: Message, b: Message) -> bool:
    """Whether two messages say the same (see the module docstring)."""
    return message_key(a) == message_key(b)


def template_message(message: Message) -> dict[str, Any]:
    """The message as the chat template gets it: string content, the fields a template reads."""
    out: dict[str, Any] = {"role": message.get("role"), "content": text_of(message.get("content"))}
    for name in ("name", "tool_call_id", "tool_calls"):
        if message.get(name):
            out[name] = message[name]
    return out


def assistant_message(text: str, turn: int) -> tuple[dict[str, Any], bool]:
    """The OpenAI assistant message for a sampled ``text``, and whether it holds tool calls.

    Well-formed calls become ``tool_calls`` (ids ``call_<turn>_<i>``) and leave the content; a turn with a malformed
    call keeps its whole text as content and no ``tool_calls`` (there is no OpenAI form for a call that does not
    parse), so the agent and its environment see what the model wrote.
    """
    calls = parse_tool_calls(text)
    if not calls or any(c.error for c in calls):
        return {"role": "assistant", "content": text}, False
    content = text
    for block in _blocks(text):
        content = content.replace(block, "")
    tool_calls = [_openai_call(c, f"call_{turn}_{i}") for i, c in enumerate(calls)]
    return {"role": "assistant", "content": content.strip() or None, "tool_calls": tool_calls}, True


def _blocks(text: str) -> list[str]:
    return re.findall(r"<tool_call>.*?</tool_call>", text, re.DOTALL)


def _openai_call(call: ToolCall, call_id: str) -> dict[str, Any]:
    arguments = json.dumps(dict(call.arguments))
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def chat_response(model: str, completion: Completion, turn: int, prompt_tokens: int) -> dict[str, Any]:
    """A ``chat.completion`` object for one sampled turn."""
    message, has_calls = assistant_message(completion.text, turn)
    reason = completion.finish_reason
    finish = "tool_calls" if has_calls and reason == "stop" else reason
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": _usage(prompt_tokens, len(completion.tokens)),
    }


def completion_response(model: str, completion: Completion, prompt_tokens: int) -> dict[str, Any]:
    """A ``text_completion`` object for one sampled completion."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": completion.text, "finish_reason": completion.finish_reason, "logprobs": None}],
        "usage": _usage(prompt_tokens, len(completion.tokens)),
    }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def matched_prefix(recorded: Sequence[Message], sent: Sequence[Message]) -> bool:
    """Whether ``sent`` starts with every message of ``recorded``, each saying the same."""
    return len(sent) >= len(recorded) and all(same_message(a, b) for a, b in zip(recorded, sent, strict=False))
