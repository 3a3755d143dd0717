"""The binary wire format: msgpack maps whose per-token arrays travel as raw little-endian buffers.

A group is the ``ScoredData`` map with each array field replaced by a descriptor::

    {"dtype": "<i4", "lengths": <bin: int32 row lengths>, "data": <bin: the rows, concatenated>}

``scores`` is ``{"dtype": "<f8", "data": <bin>}`` (or a plain list). Every other field (messages,
generation_params, env_id, policy_version, ...) is ordinary msgpack; ``token_versions`` (an int64 descriptor) is
present only when the group has it. Plain nested lists are accepted in
place of any descriptor, so a minimal client needs no numpy. A body is one such map (``/scored_data``) or
an array of them (``/scored_data_list``); a served batch is ``{"batch": [group, ...] | nil, ...}``.
Media type: ``application/msgpack``.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from rollhub.errors import InvalidInput
from rollhub.experience.group import FLOAT_FIELDS, INT_FIELDS, META_FIELDS, VERSION_FIELD, Group, Ragged
from rollhub.wire.group import group_from_json, version_rows

MEDIA_TYPE = "application/msgpack"
_INT_DTYPES = {"|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "|b1"}
_FLOAT_DTYPES = {"<f2", "<f4", "<f8"}
_LENGTH_DTYPES = {"<i4", "<i8"}


def _buffer(value: np.ndarray) -> memoryview:
    arr = np.ascontiguousarray(value)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return memoryview(arr).cast("B")


def _ragged_descriptor(arr: Ragged) -> dict[str, Any]:
    return {
        "dtype": arr.data.dtype.str,
        "lengths": _buffer(arr.lengths.astype(np.int32)),
        "data": _buffer(arr.data),
    }


def group_to_map(group: Group) -> dict[str, Any]:
    """The msgpack-ready map of a group (buffers are zero-copy views of its arrays)."""
    out: dict[str, Any] = {
        "tokens": _ragged_descriptor(group.tokens),
        "masks": _ragged_descriptor(group.masks),
        "scores": {"dtype": "<f8", "data": _buffer(group.scores.astype(np.float64, copy=False))},
    }
    for name in FLOAT_FIELDS:
        arr = getattr(group, name)
        out[name] = None if arr is None else _ragged_descriptor(arr)
    for name in META_FIELDS:
        out[name] = group.meta.get(name)
    out["env_id"] = group.env_id
    out["policy_version"] = group.policy_version
    if group.token_versions is not None:
        out[VERSION_FIELD] = _ragged_descriptor(group.token_versions)
    return out


def pack_group(group: Group) -> bytes:
    """Encode one group as msgpack bytes (also the sqlite storage format)."""
    return msgpack.packb(group_to_map(group), use_bin_type=True)


def packb(obj: Any) -> bytes:
    """msgpack-encode a response object whose groups were already turned into maps."""
    return msgpack.packb(obj, use_bin_type=True)


def unpackb(body: bytes) -> Any:
    """Decode a msgpack body; malformed bytes raise :class:`InvalidInput`."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise InvalidInput(f"body is not valid msgpack: {exc}") from None


def _decode_array(value: Any, name: str, allowed: set[str]) -> np.ndarray:
    dtype = value.get("dtype")
    data = value.get("data")
    if not isinstance(dtype, str) or dtype not in allowed:
        raise InvalidInput(f"{name}.dtype {dtype!r} is not one of {sorted(allowed)}", field=name)
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidInput(f"{name}.data must be binary (msgpack bin)", field=name)
    itemsize = np.dtype(dtype).itemsize
    if len(data) % itemsize:
        raise InvalidInput(f"{name}.data has {len(data)} bytes, not a multiple of {itemsize} ({dtype})", field=name)
    arr = np.frombuffer(data, dtype=np.dtype(dtype))
    return arr.astype(np.int8) if dtype == "|b1" else arr


_MAX_ROW = int(np.iinfo(np.int32).max)


def _decode_lengths(value: dict[str, Any], name: str) -> np.ndarray:
    """The row lengths of a descriptor as int64, each checked to be a token count (0 to 2**31 - 1)."""
    lengths = value.get("lengths")
    if isinstance(lengths, list):
        bad = next((i for i, n in enumerate(lengths) if type(n) is not int or not 0 <= n <= _MAX_ROW), None)
        if bad is not None:
            raise InvalidInput(
                f"{name}.lengths[{bad}] is {lengths[bad]!r}; row lengths must be integers from 0 to {_MAX_ROW}",
                field=name,
                index=bad,
            )
        return np.asarray(lengths, dtype=np.int64)
    if not isinstance(lengths, bytes | bytearray | memoryview):
        raise InvalidInput(f"{name}.lengths must be binary int32 row lengths or a list", field=name)
    lens = _decode_array({"dtype": value.get("lengths_dtype", "<i4"), "data": lengths}, name, _LENGTH_DTYPES)
    bad_rows = np.flatnonzero((lens < 0) | (lens > _MAX_ROW))
    if bad_rows.size:
        i = int(bad_rows[0])
        raise InvalidInput(
            f"{name}.lengths[{i}] is {int(lens[i])}; row lengths must be from 0 to {_MAX_ROW}", field=name, index=i
        )
    return lens.astype(np.int64)


def _decode_ragged(value: Any, name: str, kind: str) -> Any:
    if not isinstance(value, dict):
        return value  # list form, or None: handled by the JSON path
    data = _decode_array(value, name, _INT_DTYPES if kind == "int" else _INT_DTYPES | _FLOAT_DTYPES)
    lens = _decode_lengths(value, name)
    # every length is at most 2**31 - 1 and there are fewer than 2**32 of them: the int64 sum cannot wrap
    total = int(lens.sum())
    if total != data.size:
        raise InvalidInput(f"{name}.lengths add up to {total} values but {name}.data holds {data.size}", field=name)
    return Ragged.from_lengths(data, lens)


def group_from_map(obj: Any, *, check_advantage_lengths: bool = True) -> Group:
    """Build and validate a :class:`Group` from a decoded msgpack map (descriptors or plain lists)."""
    if not isinstance(obj, dict):
        raise InvalidInput("each group must be a msgpack map with tokens, masks and scores")
    obj = dict(obj)
    for name in INT_FIELDS:
        if name in obj:
            obj[name] = _decode_ragged(obj[name], name, "int")
    for name in FLOAT_FIELDS:
        if name in obj:
            obj[name] = _decode_ragged(obj[name], name, "float")
    if VERSION_FIELD in obj:
        obj[VERSION_FIELD] = _decode_ragged(obj[VERSION_FIELD], VERSION_FIELD, "int")
    scores = obj.get("scores")
    if isinstance(scores, dict):
        obj["scores"] = _decode_array(scores, "scores", _FLOAT_DTYPES | _INT_DTYPES)
    return group_from_json(obj, check_advantage_lengths=check_advantage_lengths)


def unpack_group(blob: bytes) -> Group:
    """Decode and validate bytes made by :func:`pack_group` (or sent by a client)."""
    return group_from_map(unpackb(blob))


def unpack_stored_group(blob: bytes) -> Group:
    """Decode a group this process stored itself: validated on the way in, so not checked again."""
    obj = unpackb(blob)
    meta = {name: obj[name] for name in META_FIELDS if obj.get(name) is not None}
    group = Group(
        tokens=_decode_ragged(obj["tokens"], "tokens", "int"),
        masks=_decode_ragged(obj["masks"], "masks", "int"),
        scores=_decode_array(obj["scores"], "scores", _FLOAT_DTYPES),
        meta=meta,
        env_id=obj.get("env_id"),
        policy_version=obj.get("policy_version"),
    )
    for name in FLOAT_FIELDS:
        value = obj.get(name)
        if value is not None:
            setattr(group, name, _decode_ragged(value, name, "float"))
    if (versions := obj.get(VERSION_FIELD)) is not None:
        group.token_versions = version_rows(_decode_ragged(versions, VERSION_FIELD, "int"))
    return group


def map_to_arrays(obj: dict[str, Any]) -> dict[str, Any]:
    """Client side: turn a served msgpack group map into numpy rows (lists of 1-D arrays) per field."""
    out = dict(obj)
    for name in (*INT_FIELDS, *FLOAT_FIELDS, VERSION_FIELD):
        value = obj.get(name)
        if isinstance(value, dict):
            kind = "float" if name in FLOAT_FIELDS else "int"
            out[name] = _decode_ragged(value, name, kind).rows()
    scores = obj.get("scores")
    if isinstance(scores, dict):
        out["scores"] = _decode_array(scores, "scores", _FLOAT_DTYPES | _INT_DTYPES)
    return out
