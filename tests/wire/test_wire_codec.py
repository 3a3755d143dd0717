"""The binary (msgpack + raw little-endian buffers) codec.

Covers the ``pack_group``/``unpack_group`` round trip (also the sqlite storage format), ``group_from_map``
with array descriptors and with plain lists, ``map_to_arrays`` on the client side, and malformed input:
bad dtype, data not a multiple of the item size, lengths that do not add up, bad lengths, garbage bytes.
Every malformed body must raise InvalidInput (or pydantic's ValidationError for type errors), never
anything else.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rollhub.errors import InvalidInput
from rollhub.experience.group import Group
from rollhub.wire.codec import (
    group_from_map,
    group_to_map,
    map_to_arrays,
    pack_group,
    packb,
    unpack_group,
    unpack_stored_group,
    unpackb,
)
from rollhub.wire.group import group_from_json, group_to_item


def descriptor(rows: list[list[Any]], dtype: str, lengths_dtype: str = "<i4") -> dict[str, Any]:
    """An array descriptor as a numpy client would send it."""
    data = np.concatenate([np.asarray(r, dtype=dtype) for r in rows]) if rows else np.empty(0, dtype)
    out = {
        "dtype": np.dtype(dtype).str,
        "lengths": np.asarray([len(r) for r in rows], dtype=lengths_dtype).tobytes(),
        "data": data.tobytes(),
    }
    if lengths_dtype != "<i4":
        out["lengths_dtype"] = lengths_dtype
    return out


TOKENS = [[1, 2, 3], [4, 5]]
MASKS = [[-100, 2, 3], [-100, 5]]


def binary_body(**fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "tokens": descriptor(TOKENS, "<i4"),
        "masks": descriptor(MASKS, "<i4"),
        "scores": {"dtype": "<f8", "data": np.array([1.0, -0.5]).tobytes()},
    }
    out.update(fields)
    return out


def served(group: Group) -> dict[str, Any]:
    return orjson.loads(orjson.dumps(group_to_item(group), option=orjson.OPT_SERIALIZE_NUMPY))


def through_msgpack(obj: Any) -> Any:
    return unpackb(msgpack.packb(obj, use_bin_type=True))


FULL_JSON: dict[str, Any] = {
    "tokens": [[1, 2, 3], [2**40, 5]],
    "masks": MASKS,
    "scores": [0.1, -2.0],
    "advantages": [[0.5, 0.25, 1.0], [2.0, 3.0]],
    "ref_logprobs": [[-0.1, -0.2, -0.3], [-1e-300, 0.0]],
    "inference_logprobs": [],
    "messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
    "generation_params": {},
    "overrides": [{"x": 1}, {}],
    "group_overrides": {"g": [1, 2]},
    "images": None,
    "env_id": 2,
    "distill_token_ids": [[[1]], [[2, 3]]],
    "distill_logprobs": [[[-0.5]], [[-0.25, -0.125]]],
    "policy_version": 7,
}


def test_pack_unpack_round_trip_keeps_every_field_and_dtype() -> None:
    group = group_from_json(FULL_JSON)
    back = unpack_group(pack_group(group))
    assert served(back) == served(group) == {k: v for k, v in FULL_JSON.items()}
    for name in ("tokens", "masks", "advantages", "ref_logprobs", "inference_logprobs"):
        assert getattr(back, name).data.dtype == getattr(group, name).data.dtype, name
    assert back.env_id == 2 and back.policy_version == 7


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_stored_round_trip_is_exact(data: st.DataObject) -> None:
    """What sqlite stores comes back as the same group, dtypes included (the trusted decode)."""
    n = data.draw(st.integers(1, 4))
    lengths = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    ints = st.integers(-(2**63), 2**63 - 1) if data.draw(st.booleans()) else st.integers(-100, 1000)
    floats = st.floats(allow_nan=False, allow_infinity=False, width=data.draw(st.sampled_from([32, 64])))
    body: dict[str, Any] = {
        "tokens": [data.draw(st.lists(ints, min_size=k, max_size=k)) for k in lengths],
        "masks": [data.draw(st.lists(ints, min_size=k, max_size=k)) for k in lengths],
        "scores": data.draw(st.lists(floats, min_size=n, max_size=n)),
        "ref_logprobs": [data.draw(st.lists(floats, min_size=k, max_size=k)) for k in lengths],
        "policy_version": data.draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))),
        "env_id": data.draw(st.one_of(st.none(), st.integers(0, 5))),
        "group_overrides": data.draw(st.sampled_from([None, {}, {"a": [1, {"b": None}]}])),
    }
    body["ref_logprobs"] = data.draw(st.sampled_from([None, [], body["ref_logprobs"]]))
    group = group_from_json(body)
    back = unpack_stored_group(pack_group(group))
    assert served(back) == served(group)
    for name in ("tokens", "masks", "ref_logprobs"):
        if getattr(group, name) is not None:
            assert getattr(back, name).data.dtype == getattr(group, name).data.dtype, name


def test_group_to_map_survives_msgpack_and_map_to_arrays() -> None:
    group = group_from_json(FULL_JSON)
    wire = unpackb(packb(group_to_map(group)))
    arrays = map_to_arrays(wire)
    assert [r.tolist() for r in arrays["tokens"]] == FULL_JSON["tokens"]
    assert [r.tolist() for r in arrays["ref_logprobs"]] == FULL_JSON["ref_logprobs"]
    assert arrays["scores"].tolist() == FULL_JSON["scores"]
    assert arrays["inference_logprobs"] == []
    assert arrays["messages"] == FULL_JSON["messages"]


def test_descriptors_build_the_same_group_as_json() -> None:
    body = binary_body(
        advantages=descriptor([[0.5, 0.25, 1.0], [0.1, 3.0]], "<f8"),
        ref_logprobs=descriptor([[0.5, 0.25, 1.0], [2.0, 3.0]], "<f4"),
        inference_logprobs=descriptor([[1, 2, 3], [4, 5]], "<i2"),
        messages=[[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
        env_id=1,
    )
    group = group_from_map(through_msgpack(body))
    item = served(group)
    assert item["tokens"] == TOKENS and item["masks"] == MASKS and item["scores"] == [1.0, -0.5]
    assert item["advantages"] == [[0.5, 0.25, 1.0], [0.1, 3.0]]
    assert item["ref_logprobs"] == [[0.5, 0.25, 1.0], [2.0, 3.0]]
    assert item["inference_logprobs"] == [[1.0, 2.0, 3.0], [4.0, 5.0]]
    assert group.ref_logprobs is not None and group.ref_logprobs.data.dtype == np.float32
    assert group.advantages is not None and group.advantages.data.dtype == np.float64
    assert item["env_id"] == 1


@pytest.mark.parametrize("dtype", ["|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "|b1"])
def test_every_integer_dtype_decodes(dtype: str) -> None:
    rows = [[1, 0, 1], [0, 1]] if dtype == "|b1" else [[1, 2, 3], [4, 5]]
    group = group_from_map(through_msgpack(binary_body(tokens=descriptor(rows, dtype))))
    assert served(group)["tokens"] == rows


def test_uint32_over_int32_widens_to_int64() -> None:
    rows = [[2**32 - 1, 2, 3], [4, 5]]
    group = group_from_map(through_msgpack(binary_body(tokens=descriptor(rows, "<u4"))))
    assert group.tokens.data.dtype == np.int64 and served(group)["tokens"] == rows


def test_int64_lengths_with_lengths_dtype() -> None:
    body = binary_body(tokens=descriptor(TOKENS, "<i4", lengths_dtype="<i8"))
    assert served(group_from_map(through_msgpack(body)))["tokens"] == TOKENS


def test_plain_lists_are_accepted_in_place_of_descriptors() -> None:
    body = {"tokens": TOKENS, "masks": MASKS, "scores": [1.0, 2.0], "ref_logprobs": [[0.1, 0.2, 0.3], [1, 2]]}
    item = served(group_from_map(through_msgpack(body)))
    assert item["tokens"] == TOKENS and item["ref_logprobs"] == [[0.1, 0.2, 0.3], [1.0, 2.0]]


def test_list_lengths_are_accepted() -> None:
    body = binary_body(tokens={"dtype": "<i4", "lengths": [3, 2], "data": np.arange(5, dtype="<i4").tobytes()})
    assert served(group_from_map(through_msgpack(body)))["tokens"] == [[0, 1, 2], [3, 4]]


def test_shape_rules_apply_to_binary_bodies() -> None:
    with pytest.raises(InvalidInput) as err:
        group_from_map(through_msgpack(binary_body(masks=descriptor([[1, 2, 3], [1]], "<i4"))))
    assert (err.value.field, err.value.index) == ("masks", 1)
    with pytest.raises(InvalidInput) as err:
        group_from_map(through_msgpack(binary_body(scores={"dtype": "<f8", "data": np.array([1.0]).tobytes()})))
    assert err.value.field == "scores"
    nan = {"dtype": "<f8", "data": np.array([1.0, np.nan]).tobytes()}
    with pytest.raises(InvalidInput) as err:
        group_from_map(through_msgpack(binary_body(scores=nan)))
    assert (err.value.field, err.value.index) == ("scores", 1)
    inf = descriptor([[0.0, 0.0, 0.0], [0.0, -np.inf]], "<f4")
    with pytest.raises(InvalidInput) as err:
        group_from_map(through_msgpack(binary_body(inference_logprobs=inf)))
    assert (err.value.field, err.value.index) == ("inference_logprobs", 1)


def float_rows(width: int) -> st.SearchStrategy[list[list[float]]]:
    values = st.floats(width=width, allow_nan=False, allow_infinity=False)
    return st.lists(st.lists(values, max_size=4), min_size=1, max_size=4)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([("<f4", 32), ("<f8", 64)]).flatmap(lambda d: st.tuples(st.just(d[0]), float_rows(d[1]))))
def test_float_descriptors_round_trip(dtype_and_rows: tuple[str, list[list[float]]]) -> None:
    dtype, rows = dtype_and_rows
    body = {
        "tokens": descriptor([[1] * len(r) for r in rows], "<i4"),
        "masks": descriptor([[1] * len(r) for r in rows], "<i4"),
        "scores": [0.0] * len(rows),
        "ref_logprobs": descriptor(rows, dtype),
    }
    group = group_from_map(through_msgpack(body))
    assert served(group)["ref_logprobs"] == rows
    assert served(unpack_group(pack_group(group)))["ref_logprobs"] == rows


# ------------------------------------------------------------------------------------------ malformed


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tokens": {"dtype": "<f4", "lengths": [1], "data": np.zeros(1, "<f4").tobytes()}}, "tokens"),
        ({"tokens": {"dtype": ">i4", "lengths": [1], "data": b"\x00" * 4}}, "tokens"),
        ({"tokens": {"dtype": "<c16", "lengths": [1], "data": b"\x00" * 16}}, "tokens"),
        ({"tokens": {"dtype": None, "lengths": [1], "data": b"\x00" * 4}}, "tokens"),
        ({"tokens": {"lengths": [1], "data": b"\x00" * 4}}, "tokens"),
        ({"ref_logprobs": {"dtype": "<U4", "lengths": [1], "data": b"\x00" * 16}}, "ref_logprobs"),
        ({"scores": {"dtype": "|O", "data": b"\x00" * 16}}, "scores"),
        ({"scores": {"data": b""}}, "scores"),
    ],
)
def test_bad_dtype_is_invalid_input(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        group_from_map(through_msgpack(binary_body(**fields)))
    assert err.value.field == field


@pytest.mark.parametrize(
    "fields",
    [
        {"tokens": {"dtype": "<i4", "lengths": [3, 2], "data": b"\x00" * 19}},
        {"masks": {"dtype": "<i8", "lengths": [3, 2], "data": b"\x00" * 36}},
        {"advantages": {"dtype": "<f4", "lengths": [3, 2], "data": b"\x00" * 6}},
        {"scores": {"dtype": "<f8", "data": b"\x00" * 12}},
        {"tokens": {"dtype": "<i4", "lengths": b"\x00" * 7, "data": b""}},
    ],
)
def test_data_size_not_a_multiple_of_itemsize_is_invalid_input(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput) as err:
        group_from_map(through_msgpack(binary_body(**fields)))
    assert err.value.field == next(iter(fields))
    assert "multiple" in err.value.message


@pytest.mark.parametrize(
    "lengths",
    [
        [3, 3],
        [3, 1],
        [],
        [-1, 6],
        np.array([3, 3], dtype="<i4").tobytes(),
        np.array([6, -1], dtype="<i4").tobytes(),
    ],
)
def test_lengths_that_do_not_sum_to_the_data_are_invalid_input(lengths: Any) -> None:
    body = binary_body(tokens={"dtype": "<i4", "lengths": lengths, "data": np.arange(5, dtype="<i4").tobytes()})
    with pytest.raises(InvalidInput) as err:
        group_from_map(through_msgpack(body))
    assert err.value.field == "tokens"


@pytest.mark.parametrize(
    "lengths",
    [["a", "b"], [2.5, 2.5], [1.0, 4.0], [True, 4], [2**63, 1], [[3], [2]], None, {"a": 1}, "35"],
)
def test_lengths_that_are_not_integer_row_lengths_are_invalid_input(lengths: Any) -> None:
    body = binary_body(tokens={"dtype": "<i4", "lengths": lengths, "data": np.arange(5, dtype="<i4").tobytes()})
    with pytest.raises(InvalidInput) as err:
        group_from_map(through_msgpack(body))
    assert err.value.field == "tokens"


def test_data_that_is_not_binary_is_invalid_input() -> None:
    body = binary_body(tokens={"dtype": "<i4", "lengths": [2], "data": [1, 2]})
    with pytest.raises(InvalidInput) as err:
        group_from_map(through_msgpack(body))
    assert err.value.field == "tokens"


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\xc1",
        b"\x92\x01",
        b"{}",
        b"\x91" * 5000,
        b"\xdd\xff\xff\xff\xff",
        b"\xd4\x01\x00",
        msgpack.packb([1, 2, 3]),
        msgpack.packb("tokens"),
        msgpack.packb({"tokens": {"dtype": "<i4"}}),
        pack_group(group_from_json({"tokens": [[1]], "masks": [[1]], "scores": [1.0]}))[:-3],
    ],
)
def test_garbage_bytes_are_invalid_input(blob: bytes) -> None:
    with pytest.raises((InvalidInput, ValidationError)):
        unpack_group(blob)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_raise_anything_else(blob: bytes) -> None:
    try:
        unpack_group(blob)
    except (InvalidInput, ValidationError):
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupted_stored_groups_never_raise_anything_else(data: st.DataObject) -> None:
    blob = bytearray(pack_group(group_from_json(FULL_JSON)))
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    try:
        unpack_group(bytes(blob))
    except (InvalidInput, ValidationError):
        pass
