"""Admission of the free-form fields of a group: only values every answer can carry are accepted.

A group's small fields (``messages``, ``generation_params``, ``overrides``, ``group_overrides``, ``images``,
``distill_token_ids``, ``distill_logprobs``) are stored exactly as the client sent them and served back later as
JSON (``/batch``, ``/latest_example``) or msgpack. A value that decodes from a request but cannot be encoded in
one of those answers would be accepted with a 200 and then fail every time it is served, so it is refused at
ingest instead (422 naming the field and the path inside it). A value is admitted when it is in the common data
model of JSON and msgpack:

* ``None``, ``True``/``False``, strings (valid UTF-8, under 4 GiB encoded);
* integers from ``-2**63`` to ``2**64 - 1`` (what both encoders write), finite floats (JSON has no NaN or inf);
* lists, and maps whose keys are all strings;
* nested at most :data:`MAX_DEPTH` containers deep, with at most :data:`MAX_VALUES` values in all free-form
  fields of one group together.

msgpack ``bin`` and extension values (a timestamp, say), maps with integer, nil or binary keys, numpy scalars and
any other Python object are refused: JSON has no form for them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

from rollhub.errors import InvalidInput

MAX_DEPTH = 32
"""Most containers nested inside one free-form field (the field's own list or map counts as one)."""
MAX_VALUES = 2**24
"""Most values (containers, keys and scalars) in all free-form fields of one group together."""
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
"""The integers both JSON (orjson) and msgpack answers encode exactly."""
MAX_STR_BYTES = 2**32 - 1
"""The longest string (UTF-8 bytes) a msgpack answer can carry."""

_SCALARS = (str, int, float, bool, type(None))


class FreeFieldError(InvalidInput):
    """A free-form field holds a value no answer can carry. ``path`` locates it inside the field.

    The message reads like ``overrides[0]["a"][3]: map key 1 (int) is not a string; ...``; the FastAPI-style
    ``loc`` is ``["body", field, *path]``.
    """

    def __init__(self, field: str, path: tuple[int | str, ...], problem: str) -> None:
        super().__init__(f"{field}{format_path(path)}: {problem}", field=field)
        self.path = path

    def detail(self) -> list[dict[str, Any]]:
        return [{"type": self.kind, "loc": ["body", self.field, *self.path], "msg": self.message}]

    @property
    def kind(self) -> str:
        return "InvalidInput"


def format_path(path: tuple[int | str, ...]) -> str:
    """``(0, "a", 3)`` as ``[0]["a"][3]`` (string keys JSON-quoted)."""
    return "".join(f"[{p}]" if isinstance(p, int) else f"[{orjson.dumps(p).decode()}]" for p in path)


class _Bad(Exception):
    """Raised at the offending value; each enclosing container prepends its index or key on the way out."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[int | str] = []


def check_free_fields(meta: Mapping[str, Any]) -> None:
    """Check every free-form field of one group (``meta``: field name to value).

    Raises:
        FreeFieldError: naming the first field, and the path inside it, that no answer can carry.
    """
    budget = [MAX_VALUES]
    for name, value in meta.items():
        try:
            _check(value, 1, budget)
        except _Bad as bad:
            raise FreeFieldError(name, tuple(reversed(bad.path)), bad.problem) from None
        except RecursionError:  # only reachable with a tiny interpreter stack; MAX_DEPTH keeps recursion short
            raise FreeFieldError(name, (), f"nested too deeply; keep it under {MAX_DEPTH} levels") from None


def _check(value: Any, depth: int, budget: list[int]) -> None:
    t = type(value)
    if t is str:
        _check_str(value)
    elif t is int:
        if not INT_MIN <= value <= INT_MAX:
            shown = value if value.bit_length() <= 128 else f"of {value.bit_length()} bits"
            raise _Bad(f"integer {shown} is outside the 64-bit range [-2**63, 2**64 - 1]; send it as a string")
    elif t is float:
        if not math.isfinite(value):
            raise _Bad(f"{value} is not a finite number (JSON cannot carry it); send null or a string instead")
    elif t is bool or value is None:
        pass
    elif t is list:
        _check_list(value, depth, budget)
    elif t is dict:
        _check_dict(value, depth, budget)
    else:
        raise _Bad(f"{_describe(value)} cannot be carried by a JSON answer; send JSON values only")


def _check_str(value: str) -> None:
    if value.isascii():
        if len(value) > MAX_STR_BYTES:
            raise _Bad(f"a string of {len(value)} bytes is longer than {MAX_STR_BYTES}")
        return
    try:
        n = len(value.encode())
    except UnicodeEncodeError as exc:
        raise _Bad(f"string is not valid Unicode ({exc.reason} at {exc.start}); send UTF-8 text") from None
    if n > MAX_STR_BYTES:
        raise _Bad(f"a string of {n} bytes is longer than {MAX_STR_BYTES}")


def _enter(n: int, depth: int, budget: list[int]) -> None:
    if depth > MAX_DEPTH:
        raise _Bad(f"nested more than {MAX_DEPTH} levels deep; flatten it or send it as a string")
    budget[0] -= n + 1
    if budget[0] < 0:
        raise _Bad(f"the free-form fields of one group hold more than {MAX_VALUES} values; send less")


def _check_list(value: list[Any], depth: int, budget: list[int]) -> None:
    _enter(len(value), depth, budget)
    if _plain_numbers(value):
        return
    for i, item in enumerate(value):
        try:
            _check(item, depth + 1, budget)
        except _Bad as bad:
            bad.path.append(i)
            raise


_INTS, _FLOATS = frozenset((int,)), frozenset((float,))


def _plain_numbers(value: list[Any]) -> bool:
    """True for a list of only in-range ints or only finite floats (distill fields), checked in C loops."""
    if not value:
        return True
    types = set(map(type, value))
    if types == _INTS:
        return min(value) >= INT_MIN and max(value) <= INT_MAX
    if types == _FLOATS:
        return math.isfinite(sum(value))  # any NaN or inf makes the sum NaN or inf (overflow: checked one by one)
    return False


def _check_dict(value: dict[Any, Any], depth: int, budget: list[int]) -> None:
    _enter(2 * len(value), depth, budget)
    for key, item in value.items():
        if type(key) is not str:
            raise _Bad(f"map key {_key_repr(key)} is not a string; JSON maps have string keys only")
        try:
            _check_str(key)
            _check(item, depth + 1, budget)
        except _Bad as bad:
            bad.path.append(key)
            raise


def _key_repr(key: Any) -> str:
    if key is None:
        return "nil (None)"
    if isinstance(key, bytes | bytearray | memoryview):
        return f"of {len(bytes(key))} binary bytes"
    if isinstance(key, int | float):
        return f"{key!r} ({type(key).__name__})"
    return _describe(key)


def _describe(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return f"a binary value (msgpack bin, {len(bytes(value))} bytes)"
    t = type(value)
    if t.__module__ == "msgpack.ext" or t.__name__ in ("ExtType", "Timestamp"):
        shown = repr(value)
        return f"a msgpack extension value ({shown[:80]}{'...' if len(shown) > 80 else ''})"
    if isinstance(value, _SCALARS):
        return f"a {t.__module__}.{t.__qualname__} value (a subclass; send the plain type)"
    return f"a {t.__module__}.{t.__qualname__} value"
