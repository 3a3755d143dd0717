"""A zero-copy msgpack reader for request bodies: ``bin`` values come back as ``memoryview`` slices of the body.

``msgpack.unpackb`` copies every ``bin`` value into a new ``bytes`` object; for a group of 16 x 2048 tokens that is
three copies of 130 KB each, on top of the body itself. This reader walks the (small) map structure in Python and
returns the per-token buffers as views, so numpy arrays can point straight into the body and the body *is* the
stored group. It decodes exactly what ``msgpack.unpackb(raw=False, strict_map_key=False)`` decodes, for the part
of msgpack that group bodies use; anything else (ext types, long arrays of scalars, deep nesting) raises
:class:`Unsupported`, and the caller decodes the body with msgpack instead. Malformed bytes raise ``ValueError``.
"""

from __future__ import annotations

import struct
from typing import Any

MAX_ARRAY = 256
"""Longer arrays (token rows sent as plain lists) are left to msgpack's C decoder, which is faster at them."""
MAX_DEPTH = 32

_F32 = struct.Struct(">f").unpack_from
_F64 = struct.Struct(">d").unpack_from
_U16 = struct.Struct(">H").unpack_from
_U32 = struct.Struct(">I").unpack_from
_U64 = struct.Struct(">Q").unpack_from
_I8 = struct.Struct(">b").unpack_from
_I16 = struct.Struct(">h").unpack_from
_I32 = struct.Struct(">i").unpack_from
_I64 = struct.Struct(">q").unpack_from


class Unsupported(Exception):
    """The body uses msgpack this reader leaves to the general decoder."""


def unpack_view(buf: memoryview) -> Any:
    """Decode one msgpack object that fills ``buf`` exactly; ``bin`` values are views of ``buf``.

    Raises:
        Unsupported: ext types, arrays longer than :data:`MAX_ARRAY`, nesting deeper than :data:`MAX_DEPTH`,
            or map keys that cannot be dict keys.
        ValueError: truncated or malformed msgpack, invalid UTF-8, or bytes after the object.
    """
    if buf.ndim != 1 or buf.itemsize != 1:
        buf = buf.cast("B")
    value, pos = _read(buf, 0, 0)
    if pos != len(buf):
        raise ValueError(f"{len(buf) - pos} bytes after the msgpack object")
    return value


def _need(buf: memoryview, end: int) -> None:
    if end > len(buf):
        raise ValueError("truncated msgpack")


def _read(buf: memoryview, pos: int, depth: int) -> tuple[Any, int]:
    _need(buf, pos + 1)
    b = buf[pos]
    pos += 1
    if b <= 0x7F:
        return b, pos
    if 0xA0 <= b <= 0xBF:
        return _str(buf, pos, b & 0x1F)
    if 0x80 <= b <= 0x8F:
        return _map(buf, pos, b & 0x0F, depth)
    if 0x90 <= b <= 0x9F:
        return _array(buf, pos, b & 0x0F, depth)
    if b >= 0xE0:
        return b - 0x100, pos
    if b == 0xC0:
        return None, pos
    if b == 0xC2:
        return False, pos
    if b == 0xC3:
        return True, pos
    if b in (0xC4, 0xC5, 0xC6):  # bin 8/16/32
        width = 1 << (b - 0xC4)
        n, pos = _length(buf, pos, width)
        _need(buf, pos + n)
        return buf[pos : pos + n], pos + n
    if b == 0xCA:
        _need(buf, pos + 4)
        return _F32(buf, pos)[0], pos + 4
    if b == 0xCB:
        _need(buf, pos + 8)
        return _F64(buf, pos)[0], pos + 8
    if 0xCC <= b <= 0xCF:  # uint 8/16/32/64
        width = 1 << (b - 0xCC)
        return _length(buf, pos, width)
    if 0xD0 <= b <= 0xD3:  # int 8/16/32/64
        width = 1 << (b - 0xD0)
        _need(buf, pos + width)
        reader = (_I8, _I16, _I32, _I64)[b - 0xD0]
        return reader(buf, pos)[0], pos + width
    return _rest(buf, pos, b, depth)


def _rest(buf: memoryview, pos: int, b: int, depth: int) -> tuple[Any, int]:
    """The rarer type bytes: long strings, arrays and maps; 0xc1 and ext types."""
    if b in (0xD9, 0xDA, 0xDB):  # str 8/16/32
        n, pos = _length(buf, pos, 1 << (b - 0xD9))
        return _str(buf, pos, n)
    if b in (0xDC, 0xDD):  # array 16/32
        n, pos = _length(buf, pos, 2 if b == 0xDC else 4)
        return _array(buf, pos, n, depth)
    if b in (0xDE, 0xDF):  # map 16/32
        n, pos = _length(buf, pos, 2 if b == 0xDE else 4)
        return _map(buf, pos, n, depth)
    if b == 0xC1:
        raise ValueError("byte 0xc1 is never used in msgpack")
    raise Unsupported(f"msgpack type byte 0x{b:02x} (ext)")


def _length(buf: memoryview, pos: int, width: int) -> tuple[int, int]:
    _need(buf, pos + width)
    if width == 1:
        return buf[pos], pos + 1
    if width == 2:
        return _U16(buf, pos)[0], pos + 2
    if width == 4:
        return _U32(buf, pos)[0], pos + 4
    return _U64(buf, pos)[0], pos + 8


def _str(buf: memoryview, pos: int, n: int) -> tuple[str, int]:
    _need(buf, pos + n)
    return str(buf[pos : pos + n], "utf-8"), pos + n


def _array(buf: memoryview, pos: int, n: int, depth: int) -> tuple[list[Any], int]:
    if n > MAX_ARRAY:
        raise Unsupported(f"array of {n} elements")
    if depth >= MAX_DEPTH:
        raise Unsupported("nesting deeper than MAX_DEPTH")
    out = []
    for _ in range(n):
        value, pos = _read(buf, pos, depth + 1)
        out.append(value)
    return out, pos


def _map(buf: memoryview, pos: int, n: int, depth: int) -> tuple[dict[Any, Any], int]:
    if depth >= MAX_DEPTH:
        raise Unsupported("nesting deeper than MAX_DEPTH")
    out: dict[Any, Any] = {}
    for _ in range(n):
        key, pos = _read(buf, pos, depth + 1)
        if isinstance(key, list | dict | memoryview):
            raise Unsupported(f"map key of type {type(key).__name__}")
        out[key], pos = _read(buf, pos, depth + 1)
    return out, pos
