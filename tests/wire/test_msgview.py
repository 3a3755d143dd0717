"""The zero-copy msgpack reader decodes exactly what msgpack does, or steps aside."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollhub.wire import codec
from rollhub.wire.group import group_from_json
from rollhub.wire.msgview import MAX_ARRAY, Unsupported, unpack_view

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=300)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=6)
    ),
    max_leaves=30,
)


def plain(value: Any) -> Any:
    """memoryviews as bytes, so results compare with msgpack's."""
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


@settings(max_examples=300, deadline=None, derandomize=True)
@given(values, st.booleans())
def test_decodes_what_msgpack_decodes(value: Any, single_float: bool) -> None:
    try:
        body = msgpack.packb(value, use_bin_type=True, use_single_float=single_float)
    except OverflowError:  # a float past float32's range with single_float
        body = msgpack.packb(value, use_bin_type=True)
    expected = msgpack.unpackb(body, raw=False, strict_map_key=False)
    assert plain(unpack_view(memoryview(body))) == expected


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=64))
def test_garbage_is_refused_or_decoded_like_msgpack(body: bytes) -> None:
    try:
        expected = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception:
        with pytest.raises((ValueError, Unsupported)):
            unpack_view(memoryview(body))
        return
    try:
        got = unpack_view(memoryview(body))
    except Unsupported:
        return  # stepping aside is always allowed
    assert plain(got) == expected


def test_bin_values_are_views_of_the_body() -> None:
    body = bytearray(
        codec.pack_group(group_from_json({"tokens": [[1, 2, 3]], "masks": [[-100, 2, 3]], "scores": [1.0]}))
    )
    view = memoryview(body)
    obj = unpack_view(view)
    data = obj["tokens"]["data"]
    assert isinstance(data, memoryview) and data.obj is body
    start = bytes(body).index(bytes(data))
    body[start] = 7  # writing the body shows through the decoded value: no copy was made
    assert data[0] == 7


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (msgpack.packb(list(range(MAX_ARRAY + 1))), Unsupported),  # long scalar arrays: msgpack's C decoder is faster
        (msgpack.packb(msgpack.ExtType(1, b"x")), Unsupported),
        (msgpack.packb({b"k": 1}, use_bin_type=True), Unsupported),  # bytes keys
        (msgpack.packb([1, 2]) + b"\x01", ValueError),  # trailing bytes
        (msgpack.packb("é")[:-1], ValueError),  # truncated
        (b"\xa2\xff\xfe", ValueError),  # not UTF-8
    ],
)
def test_what_it_leaves_to_msgpack(body: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        unpack_view(memoryview(body))
