"""A small TOML writer for configs (plain values, tables, arrays of tables); ``None`` values are left out.

TOML has no null, so a setting that can be off is written ``false``: :func:`false_is_none` and
:func:`none_as_false` are the pydantic validator and serializer that read and write it that way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any


def false_is_none(true_message: str) -> Callable[[Any, Any], Any]:
    """A ``mode="before"`` field validator: ``false`` is ``None`` (off); ``true`` is refused with ``true_message``."""

    def check(cls: Any, value: Any) -> Any:
        if value is True:
            raise ValueError(true_message)
        return None if value is False else value

    return check


def none_as_false(self: Any, value: Any) -> Any:
    """A ``when_used="json"`` field serializer: ``None`` (off) is written ``false``, which config.toml can hold."""
    return False if value is None else value


def _key(key: str) -> str:
    return key if key and all(c.isalnum() or c in "-_" for c in key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def dumps(data: dict[str, Any], prefix: str = "") -> str:
    """``data`` as TOML text: plain keys first, then ``[tables]`` and ``[[arrays of tables]]``."""
    lines: list[str] = []
    nested: list[tuple[str, Any]] = []
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, dict) or _is_table_array(value):
            nested.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    out = "\n".join(lines) + ("\n" if lines else "")
    for key, value in nested:
        name = f"{prefix}{_key(key)}"
        if isinstance(value, dict):
            out += f"\n[{name}]\n" + dumps(value, prefix=f"{name}.")
        else:
            for item in value:
                out += f"\n[[{name}]]\n" + dumps(item, prefix=f"{name}.")
    return out
