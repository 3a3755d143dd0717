"""Tool calls in the Qwen format: parsed from what the model wrote, run, and every failure turned into a message."""

from __future__ import annotations

from rollhub.envs.episode.calculator import CALC
from rollhub.envs.episode.tools import ToolCall, parse_tool_calls, run_tool_call


def test_calls_are_parsed_in_order_with_object_or_string_arguments() -> None:
    text = ('let me see <tool_call>{"name": "calc", "arguments": {"a": 2, "b": 3}}</tool_call> and '
            '<tool_call>{"name": "calc", "arguments": "{\\"a\\": 4, \\"b\\": 5}"}</tool_call>')  # fmt: skip
    calls = parse_tool_calls(text)
    assert calls == [ToolCall("calc", {"a": 2, "b": 3}), ToolCall("calc", {"a": 4, "b": 5})]
    assert [run_tool_call(c, [CALC]).content for c in calls] == ["6", "20"]
    assert parse_tool_calls("46") == []


def test_every_malformed_call_becomes_an_error_result() -> None:
    cases = {
        '<tool_call>{"name": "calc", "arguments": {"a": 2</tool_call>': "not JSON",
        '<tool_call>{"name": "calc", "arguments": {"a": 2}': "not closed",
        '<tool_call>["calc"]</tool_call>': 'string "name"',
        '<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "calc", "arguments": "{oops"}</tool_call>': "string that is not JSON",
        '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>': "no tool named 'abacus' (tools: calc)",
        '<tool_call>{"name": "calc", "arguments": {"a": 2}}</tool_call>': "TypeError",
        '<tool_call>{"name": "calc", "arguments": {"a": 2, "b": "x"}}</tool_call>': "ValueError",
    }
    for text, expected in cases.items():
        (call,) = parse_tool_calls(text)
        result = run_tool_call(call, [CALC])
        assert not result.ok and result.content.startswith("error: ") and expected in result.content, text
