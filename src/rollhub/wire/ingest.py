"""The one decoder of ingest bodies: ``decode_groups(body, content_type, many=...)`` for every ingest route.

A body is one ``ScoredData`` group (``POST /scored_data``, ``many=False``) or a list of them
(``/scored_data_list``, ``many=True``), as JSON or as msgpack (:mod:`rollhub.wire.codec`). Whichever way it
travelled, the groups come back validated and in the same storage form (:mod:`rollhub.wire.group`: int32
token rows, float32 log-probs when exact), or one :class:`BodyInvalid` whose FastAPI-style ``detail`` names
the field and the index at fault. Nothing is stored by decoding.

Faster readers are tried first and give exactly what the general decoders give: simdjson for JSON
(:mod:`rollhub.wire.fastjson`) and, for a msgpack body handed over as a ``memoryview``, the zero-copy reader
(:mod:`rollhub.wire.msgview`) whose per-token arrays point into the body. Anything unusual, and every error,
is decided (and worded) by the general decoders: orjson + :func:`~rollhub.wire.group.group_from_json`, and
``msgpack`` + :func:`~rollhub.wire.codec.group_from_map`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from pydantic import ValidationError

from rollhub.errors import InvalidInput
from rollhub.experience.group import FLOAT_FIELDS, INT_FIELDS, META_FIELDS, VERSION_FIELD, Group, memory_owner
from rollhub.wire import codec
from rollhub.wire.fastjson import parse_groups
from rollhub.wire.group import group_from_json
from rollhub.wire.msgview import unpack_view

Body = bytes | memoryview


class BodyInvalid(InvalidInput):
    """An ingest body that does not decode to valid groups (answered 422); nothing of it was stored.

    Attributes:
        entries: FastAPI-style ``detail`` entries (``type``, ``loc`` starting with ``"body"``, ``msg``,
            ``input``, ``ctx``), worded as FastAPI words a body model's errors. ``input`` holds what the
            client sent, so a JSON encoder must be lenient with it.
    """

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        first = entries[0] if entries else {}
        where = ".".join(str(p) for p in first.get("loc", ["body"])[1:]) or "body"
        super().__init__(f"{where}: {first.get('msg', 'invalid body')}")
        self.entries = entries

    def detail(self) -> list[dict[str, Any]]:
        return self.entries


def decode_groups(body: Body, content_type: str, *, many: bool, check_advantage_lengths: bool = True) -> list[Group]:
    """The validated groups of an ingest body.

    Args:
        body: the request body. A ``memoryview`` of a msgpack body may be kept: the arrays of the groups are
            views of it, and a single group that it encodes exactly gets it as ``Group.wire`` (stored as is).
        content_type: the request's ``Content-Type``; ``application/msgpack`` selects msgpack, anything else
            is read as JSON.
        many: a list of groups (``/scored_data_list``) rather than one group (``/scored_data``).
        check_advantage_lengths: require advantage rows as long as token rows.

    Raises:
        BodyInvalid: a missing, undecodable or invalid body, naming the field and (for a list) the index.
        InvalidInput: a msgpack body that is not msgpack at all.
    """
    if not len(body):
        raise BodyInvalid([{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}])
    if content_type.startswith(codec.MEDIA_TYPE):
        if isinstance(body, memoryview):
            try:
                return _from_view(body, many, check_advantage_lengths)
            except Exception:  # anything unusual: the general decoder decides and words it
                pass
        obj = codec.unpackb(bytes(body))
        return _groups(obj, many, check_advantage_lengths, codec.group_from_map)
    raw = bytes(body)
    groups = parse_groups(raw, many=many, check_advantage_lengths=check_advantage_lengths)
    if groups is not None:
        return groups
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyInvalid([_json_invalid(exc)]) from None
    return _groups(obj, many, check_advantage_lengths, group_from_json)


def _json_invalid(exc: orjson.JSONDecodeError) -> dict[str, Any]:
    return {
        "type": "json_invalid",
        "loc": ["body", exc.pos],
        "msg": "JSON decode error",
        "input": {},
        "ctx": {"error": exc.msg},
    }


def _from_view(view: memoryview, many: bool, strict: bool) -> list[Group]:
    obj = unpack_view(view)
    groups = _groups(obj, many, strict, codec.group_from_map)
    if not many and _decodes_back_exactly(obj, groups[0], view):
        groups[0].wire = view
    return groups


def _groups(obj: Any, many: bool, strict: bool, convert: Callable[..., Group]) -> list[Group]:
    if not many:
        return [_group(obj, strict, convert, ())]
    if not isinstance(obj, list):
        not_list = {"type": "list_type", "loc": ["body"], "msg": "Input should be a valid list", "input": None}
        raise BodyInvalid([not_list])
    return [_group(item, strict, convert, (i,)) for i, item in enumerate(obj)]


def _group(obj: Any, strict: bool, convert: Callable[..., Group], prefix: tuple[Any, ...]) -> Group:
    try:
        return convert(obj, check_advantage_lengths=strict)
    except ValidationError as exc:
        raise BodyInvalid(pydantic_entries(exc, prefix)) from None
    except InvalidInput as exc:
        raise BodyInvalid(invalid_entries(exc, prefix)) from None


def pydantic_entries(exc: ValidationError, prefix: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """pydantic errors as FastAPI words them for a body model (``loc`` = ``body``, ``prefix``, the field)."""
    out = []
    for err in exc.errors(include_url=False):
        entry = {"type": err["type"], "loc": ["body", *prefix, *err["loc"]], "msg": err["msg"]}
        entry["input"] = err.get("input")
        if "ctx" in err:
            entry["ctx"] = {k: str(v) if isinstance(v, Exception) else v for k, v in err["ctx"].items()}
        out.append(entry)
    return out


def invalid_entries(exc: InvalidInput, prefix: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """``exc.detail()`` with ``prefix`` (the group's index in a list body) after ``body`` in each ``loc``."""
    detail = exc.detail()
    for entry in detail:
        entry["loc"] = ["body", *prefix, *entry["loc"][1:]]
    return detail


_STORED_KEYS = frozenset(
    (*INT_FIELDS, *FLOAT_FIELDS, VERSION_FIELD, *META_FIELDS, "scores", "env_id", "policy_version")
)


def _decodes_back_exactly(obj: Any, group: Group, view: memoryview) -> bool:
    """Whether the body, decoded as storage decodes it, gives ``group`` again: every array of the group is a
    view of the body (so no dtype was converted), no small field needed pydantic, and no key is unknown."""
    if not isinstance(obj, dict) or not _STORED_KEYS.issuperset(obj) or group.meta:
        return False
    region = view.obj
    arrays = [group.scores] + [r.data for r in (group.tokens, group.masks) if r is not None]
    arrays += [r.data for r in (getattr(group, name) for name in (*FLOAT_FIELDS, VERSION_FIELD)) if r is not None]
    return all(a.size == 0 or memory_owner(a) is region for a in arrays) and group.scores.dtype == np.float64
