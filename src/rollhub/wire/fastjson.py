"""The fast JSON path for scored groups: numeric arrays go from JSON text straight into numpy.

A ``ScoredData`` body is mostly numbers; parsing it into Python lists of ints and floats and then into arrays
costs most of the server's time. Here simdjson reads each per-token field into one flat buffer in C
(``Array.as_buffer``), so no Python number is ever made. The path is taken only when it gives exactly what the
general path (orjson + :func:`rollhub.wire.group.group_from_json`) would give: anything unusual - an element of the
wrong type, a nested array, a number out of range, a shape error - returns None and the caller uses the general
path, which accepts the same bodies and words every error. Without the simdjson package every body takes the
general path.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from pydantic import ValidationError

from rollhub.errors import RollhubError
from rollhub.experience.group import FLOAT_FIELDS, INT_FIELDS, VERSION_FIELD, Group, Ragged
from rollhub.wire.group import apply_meta, check_group, float_array, int_array, version_rows
from rollhub.wire.models import SMALL_FIELDS, ScoredDataMeta

try:
    import simdjson
except ImportError:  # pragma: no cover - the package is a core dependency; this keeps odd platforms working
    simdjson = None

_NUMERIC = (*INT_FIELDS, *FLOAT_FIELDS, VERSION_FIELD)


class _Fallback(Exception):
    """This body needs the general path."""


_local = threading.local()
REUSE_MAX = 16 * 2**20
"""Bodies up to this size reuse one parser per thread. A fresh parser allocates (and the kernel zeroes) buffers a
few times the document's size on every call: measured at nearly half the JSON ingest time for 1 MB groups. Larger
bodies get a parser of their own, so the cached one never holds buffers sized for a rare huge body."""


def _parse(body: bytes) -> Any:
    if len(body) > REUSE_MAX:
        return simdjson.Parser().parse(body)
    parser = getattr(_local, "parser", None)
    if parser is None:
        parser = _local.parser = simdjson.Parser()
    try:
        return parser.parse(body)
    except RuntimeError as exc:
        if "re-use" not in str(exc):  # anything but "objects of the last document are still alive"
            raise
        return simdjson.Parser().parse(body)


def _brackets(value: Any) -> int:
    """'[' characters in the JSON text of a parsed value (its strings included)."""
    if isinstance(value, simdjson.Array | simdjson.Object):
        return value.mini.count(b"[")
    if isinstance(value, str):
        return value.count("[")
    return 0


def _ragged(value: Any, name: str) -> tuple[Ragged, int]:
    """The field as a Ragged, and the number of '[' its JSON text holds if it is a plain 2-D array."""
    if not isinstance(value, simdjson.Array):
        raise _Fallback
    lengths = []
    for row in value:
        if not isinstance(row, simdjson.Array):
            raise _Fallback
        lengths.append(len(row))
    kind = "d" if name in FLOAT_FIELDS else "i"
    try:
        flat = np.frombuffer(value.as_buffer(of_type=kind), dtype=np.int64 if kind == "i" else np.float64)
    except (TypeError, ValueError, RuntimeError):
        raise _Fallback from None
    if flat.size != sum(lengths):
        raise _Fallback  # a nested array was flattened
    data = int_array(flat, name) if kind == "i" else float_array(flat, name)
    return Ragged.from_lengths(data, np.asarray(lengths, dtype=np.int64)), 1 + len(lengths)


def _scores(value: Any) -> np.ndarray:
    """``scores`` as float64, when it is a flat array of numbers."""
    if not isinstance(value, simdjson.Array):
        raise _Fallback
    try:
        scores = np.frombuffer(value.as_buffer(of_type="d"), dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):
        raise _Fallback from None
    if scores.size != len(value):
        raise _Fallback
    return scores


def _group(obj: Any, check_advantage_lengths: bool) -> tuple[Group, int]:
    if not isinstance(obj, simdjson.Object):
        raise _Fallback
    keys = list(obj.keys())  # simdjson objects iterate differently from dicts
    if len(set(keys)) != len(keys):
        raise _Fallback  # a repeated key: the general parser keeps the last value, as JSON parsers commonly do
    brackets = sum(k.count("[") for k in keys)
    fields: dict[str, Any] = {}
    small: dict[str, Any] = {}
    for key in keys:
        try:
            value = obj[key]
        except KeyError:  # simdjson cannot look up some keys (one holding a NUL character)
            raise _Fallback from None
        if key in _NUMERIC:
            if value is None:
                continue
            fields[key], used = _ragged(value, key)
            brackets += used
        elif key == "scores":
            fields[key] = _scores(value)
            brackets += 1
        else:
            brackets += _brackets(value)
            if key in SMALL_FIELDS:
                small[key] = (
                    value.as_list()
                    if isinstance(value, simdjson.Array)
                    else (value.as_dict() if isinstance(value, simdjson.Object) else value)
                )
    if not all(k in fields for k in ("tokens", "masks", "scores")):
        raise _Fallback
    try:
        meta = ScoredDataMeta.model_validate(small)
    except ValidationError:
        raise _Fallback from None
    group = Group(tokens=fields["tokens"], masks=fields["masks"], scores=fields["scores"])
    for name in FLOAT_FIELDS:
        setattr(group, name, fields.get(name))
    if (versions := fields.get(VERSION_FIELD)) is not None:
        group.token_versions = version_rows(versions)
    apply_meta(group, meta)
    try:
        check_group(group, check_advantage_lengths=check_advantage_lengths)
    except RollhubError:
        raise _Fallback from None
    return group, brackets


def parse_groups(body: bytes, *, many: bool, check_advantage_lengths: bool = True) -> list[Group] | None:
    """Parse a ``/scored_data`` (``many=False``) or ``/scored_data_list`` body, or None for the general path."""
    if simdjson is None:
        return None
    try:
        doc = _parse(body)
    except (ValueError, TypeError, RuntimeError):  # invalid JSON, or a number past 64 bits (BIGINT_ERROR)
        return None
    try:
        if many:
            if not isinstance(doc, simdjson.Array):
                return None
            parsed = [_group(obj, check_advantage_lengths) for obj in doc]
            brackets = 1 + sum(n for _, n in parsed)
        else:
            parsed = [_group(doc, check_advantage_lengths)]
            brackets = parsed[0][1]
    except _Fallback:
        return None
    finally:
        del doc
    if body.count(b"[") != brackets:
        return None  # some array sat where a number belongs
    return [g for g, _ in parsed]
