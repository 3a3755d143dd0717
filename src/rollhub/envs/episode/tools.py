"""Tools in the OpenAI style: a JSON-schema description for the chat template, a function to run, and the parser
of the model's calls in its template's tool format.

The default format is Qwen's, which rollhub's tiny model's template also uses: a call is
``<tool_call>{"name": "calc", "arguments": {"a": 1}}</tool_call>`` anywhere in the assistant's text, and a turn
may hold several. What the model wrote is parsed, never trusted: an unclosed tag, text that is not JSON, a call
without a string ``name`` or with ``arguments`` that are not an object, an unknown tool, arguments the function
refuses, or a function that raises all become a :class:`ToolResult` with ``ok=False`` whose message goes back to
the model as the tool's answer. A malformed call is a scored turn (:class:`~rollhub.envs.episode.base.ToolEnv`
gives it ``malformed_reward``), never a crash.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call.

    Attributes:
        name: what the model writes in a call.
        description: one line for the tool list the template renders.
        parameters: the JSON schema of the arguments (an ``"object"`` schema).
        fn: called with the arguments as keyword arguments; returns the text the model reads back. An exception
            it raises (``TypeError`` for arguments it does not take, ``ValueError`` for bad values) is reported
            to the model as the call's result.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Any] = field(compare=False)

    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call (``arguments`` already decoded) or, with ``error`` set, one that could not be parsed."""

    name: str
    arguments: Mapping[str, Any]
    error: str = ""


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What running a call gave: ``content`` goes back to the model as a ``tool`` message."""

    name: str
    content: str
    ok: bool


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in an assistant turn, in order; a malformed one comes back with ``error`` set (never raises)."""
    calls = []
    for match in _CALL.finditer(text):
        calls.append(_parse_one(match.group(1)))
    rest = _CALL.sub("", text)
    if _OPEN in rest:
        calls.append(ToolCall("", {}, "a <tool_call> is not closed by </tool_call>"))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall("", {}, f"the call is not JSON ({exc.msg} at {exc.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall("", {}, 'the call must be a JSON object with a string "name"')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # the OpenAI wire form: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(value["name"], {}, '"arguments" is a string that is not JSON')
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], {}, '"arguments" must be a JSON object')
    return ToolCall(value["name"], arguments)


def run_tool_call(call: ToolCall, tools: Sequence[Tool]) -> ToolResult:
    """Run one call against ``tools``; every failure becomes a result with ``ok=False`` (never raises)."""
    if call.error:
        return ToolResult(call.name, f"error: {call.error}", False)
    tool = next((t for t in tools if t.name == call.name), None)
    if tool is None:
        known = ", ".join(t.name for t in tools) or "none"
        return ToolResult(call.name, f"error: no tool named {call.name!r} (tools: {known})", False)
    try:
        out = tool.fn(**call.arguments)
    except Exception as exc:  # the model's arguments, not the caller's bug: reported back to the model
        return ToolResult(call.name, f"error: {type(exc).__name__}: {exc}", False)
    return ToolResult(call.name, out if isinstance(out, str) else json.dumps(out), True)
