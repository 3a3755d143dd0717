"""Admission of free-form fields and strict binary descriptors, at the wire level.

Every poison kind a served answer cannot carry (msgpack bin and ext values, maps with integer or nil keys, deep
nesting, non-finite floats, integers past 64 bits, foreign Python objects) is refused by every Group constructor
with an :class:`InvalidInput` naming the field and the path inside it; descriptors whose row lengths wrap around
or disagree with the data are refused too.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import msgpack
import numpy as np
import orjson
import pytest

from rollhub.errors import InvalidInput
from rollhub.experience.group import Group, Ragged
from rollhub.wire import admission, codec
from rollhub.wire.admission import MAX_DEPTH, FreeFieldError, check_free_fields
from rollhub.wire.fastjson import parse_groups
from rollhub.wire.group import check_group, group_from_json, group_to_item

BASE: dict[str, Any] = {"tokens": [[1, 2, 3], [4, 5]], "masks": [[-100, 2, 3], [-100, 5]], "scores": [1.0, 0.5]}


def nested(depth: int, leaf: Any = 0) -> Any:
    """``depth`` lists around ``leaf`` (depth 1 is ``[leaf]``)."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def through_msgpack(obj: Any) -> Any:
    """What the server's msgpack decoder makes of ``obj`` (timestamps come back as msgpack Timestamps)."""
    return codec.unpackb(msgpack.packb(obj, use_bin_type=True, datetime=True))


# (field, value as a msgpack client sends it, the path and words the error must carry)
MSGPACK_POISON = [
    ("images", [b"\x89PNG"], "images[0]", "binary value (msgpack bin"),
    ("generation_params", {"t": msgpack.ExtType(5, b"xy")}, 'generation_params["t"]', "msgpack extension"),
    (
        "group_overrides",
        {"when": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)},
        'group_overrides["when"]',
        "msgpack extension",
    ),
    ("overrides", [{"a": [0, 1, 2, {1: "x"}]}, {}], 'overrides[0]["a"][3]', "map key 1 (int) is not a string"),
    ("group_overrides", {"k": {None: 1}}, 'group_overrides["k"]', "map key nil (None) is not a string"),
    ("images", {b"raw": 1}, "images", "binary bytes is not a string"),
    ("images", {"deep": nested(300)}, 'images["deep"]' + "[0]" * (MAX_DEPTH - 1), "nested more than 32"),
    ("distill_logprobs", [[[float("nan")]], [[0.5]]], "distill_logprobs[0][0][0]", "nan is not a finite number"),
    ("images", [1.0, float("-inf")], "images[1]", "-inf is not a finite number"),
    ("generation_params", {"seed": 2**64}, 'generation_params["seed"]', "outside the 64-bit range"),
    ("images", {"k": -(2**63) - 1}, 'images["k"]', "outside the 64-bit range"),
]


@pytest.mark.parametrize(("field", "value", "path", "words"), MSGPACK_POISON)
def test_msgpack_poison_is_refused_naming_field_and_path(field: str, value: Any, path: str, words: str) -> None:
    try:
        obj = through_msgpack({**BASE, field: value})
    except (ValueError, OverflowError):
        obj = {**BASE, field: value}  # msgpack cannot even encode it (a 65-bit integer): check the value itself
    with pytest.raises(InvalidInput) as err:
        codec.group_from_map(obj)
    assert err.value.field == field
    assert err.value.message.startswith(f"{path}: "), err.value.message
    assert words in err.value.message


def test_the_issue_example_path_and_loc() -> None:
    with pytest.raises(FreeFieldError) as err:
        group_from_json({**BASE, "overrides": [{"a": [0, 1, 2, {1: "x"}]}, {}]})
    assert err.value.message.startswith('overrides[0]["a"][3]: map key 1 (int) is not a string')
    assert err.value.detail()[0]["loc"] == ["body", "overrides", 0, "a", 3]
    assert err.value.detail()[0]["type"] == "InvalidInput"


def test_deep_json_is_refused_on_the_general_and_fast_json_paths() -> None:
    body = json.dumps({**BASE, "images": nested(300)}).encode()  # orjson refuses to write it: so would /batch
    assert parse_groups(body, many=False) is None  # the fast path leaves it to the general path...
    with pytest.raises(InvalidInput) as err:  # ...which words the error
        group_from_json(orjson.loads(body))
    assert err.value.field == "images" and "nested more than 32" in err.value.message


def test_nesting_up_to_the_limit_is_accepted_and_served_both_ways() -> None:
    value = {"m": nested(MAX_DEPTH - 1, "leaf")}
    group = group_from_json({**BASE, "group_overrides": value})
    assert (
        orjson.loads(orjson.dumps(group_to_item(group), option=orjson.OPT_SERIALIZE_NUMPY))["group_overrides"] == value
    )
    assert codec.unpack_group(codec.pack_group(group)).meta["group_overrides"] == value
    with pytest.raises(InvalidInput):
        group_from_json({**BASE, "group_overrides": {"m": nested(MAX_DEPTH, "leaf")}})


def test_extreme_but_carriable_values_are_accepted() -> None:
    images = {"big": 2**64 - 1, "small": -(2**63), "tiny": 5e-324, "neg0": -0.0, "text": "é\u2028", "": None}
    group = group_from_json({**BASE, "images": images})
    served = orjson.loads(orjson.dumps(group_to_item(group), option=orjson.OPT_SERIALIZE_NUMPY))
    assert served["images"] == images
    assert str(served["images"]["neg0"]) == "-0.0"
    assert codec.unpack_group(codec.pack_group(group)).meta["images"] == images


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (np.float32(1.5), "numpy.float32"),
        ((1, 2), "builtins.tuple"),
        ({"s": "\ud800"}, "not valid Unicode"),
        (object(), "builtins.object"),
    ],
)
def test_in_process_groups_with_foreign_values_are_refused(value: Any, words: str) -> None:
    group = group_from_json(BASE)
    group.meta["images"] = value
    with pytest.raises(InvalidInput) as err:
        check_group(group)
    assert err.value.field == "images" and words in err.value.message


def test_the_size_limit_counts_every_free_field_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "MAX_VALUES", 10)
    check_free_fields({"images": [1, 2, 3], "generation_params": {"a": 1}})  # 4 + 3 values
    with pytest.raises(FreeFieldError) as err:
        check_free_fields({"images": [1, 2, 3], "generation_params": {"a": 1, "b": 2, "c": 3}})
    assert err.value.field == "generation_params" and "more than 10 values" in err.value.message


def test_number_lists_take_the_fast_check_and_still_find_the_bad_value() -> None:
    check_free_fields({"distill_logprobs": [[[1e308, 1e308, -0.5]]]})  # the sum overflows; every value is finite
    with pytest.raises(FreeFieldError) as err:
        check_free_fields({"distill_token_ids": [[[1, 2]], [[3, 2**64]]]})
    assert err.value.message.startswith("distill_token_ids[1][0][1]: integer")


# ---------------------------------------------------------------------------------------------- descriptors
DATA8 = np.arange(8, dtype="<i4").tobytes()


def ragged_body(lengths: Any, lengths_dtype: str | None = None, data: bytes = DATA8) -> dict[str, Any]:
    tokens: dict[str, Any] = {"dtype": "<i4", "lengths": lengths, "data": data}
    if lengths_dtype is not None:
        tokens["lengths_dtype"] = lengths_dtype
    masks = {"dtype": "<i4", "lengths": [len(data) // 4], "data": data}
    return {"tokens": tokens, "masks": masks, "scores": [1.0]}


WRAPPING = [
    pytest.param(np.array([2**62, 2**62, 2**62, 2**62 + 8], "<i8").tobytes(), "<i8", id="i8-huge-wraps-to-8"),
    pytest.param(np.array([-(2**62), 2**62 + 8], "<i8").tobytes(), "<i8", id="i8-negative-sums-to-8"),
    pytest.param(np.array([-8, 16], "<i4").tobytes(), None, id="i4-negative-sums-to-8"),
    pytest.param(np.array([2**31 - 1, 2**31 - 1, 10], "<i8").tobytes(), "<i8", id="i8-over-int32"),
    pytest.param([2**63 - 1, 2**63 - 1, 10], None, id="list-huge-wraps-to-8"),
    pytest.param([-(2**63), 2**63 - 1, 9], None, id="list-negative-sums-to-8"),
    pytest.param([-1, 9], None, id="list-negative"),
    pytest.param([2**31, 8], None, id="list-over-int32"),
]


@pytest.mark.parametrize(("lengths", "lengths_dtype"), WRAPPING)
def test_row_lengths_that_wrap_or_leave_int32_are_refused(lengths: Any, lengths_dtype: str | None) -> None:
    with pytest.raises(InvalidInput) as err:
        codec.group_from_map(through_msgpack(ragged_body(lengths, lengths_dtype)))
    assert err.value.field == "tokens"
    assert "lengths" in err.value.message


def test_the_largest_valid_lengths_still_decode() -> None:
    body = ragged_body(np.array([0, 8, 0], "<i8").tobytes(), "<i8")
    body["masks"]["lengths"], body["scores"] = [0, 8, 0], [1.0, 2.0, 3.0]
    group = codec.group_from_map(through_msgpack(body))
    assert group.tokens.lengths.tolist() == [0, 8, 0]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"masks": {"dtype": "<i4", "lengths": [3, 5], "data": DATA8}}, "masks"),
        ({"inference_logprobs": {"dtype": "<f4", "lengths": [8, 0], "data": b"\x00" * 32}}, "inference_logprobs"),
        ({"masks": {"dtype": "<i8", "lengths": [8], "data": DATA8}}, "masks"),  # 32 bytes are 4 int64, not 8
        ({"scores": {"dtype": "<f8", "data": b"\x00" * 12}}, "scores"),
    ],
)
def test_shapes_that_disagree_across_fields_are_refused(fields: dict[str, Any], field: str) -> None:
    body = {**ragged_body([4, 4]), "masks": {"dtype": "<i4", "lengths": [4, 4], "data": DATA8}, "scores": [1.0, 2.0]}
    with pytest.raises(InvalidInput) as err:
        codec.group_from_map(through_msgpack({**body, **fields}))
    assert err.value.field == field


def test_stored_groups_decode_through_the_same_strict_lengths() -> None:
    group = Group(tokens=Ragged.from_rows([np.arange(3)], np.int32), masks=Ragged.from_rows([np.arange(3)], np.int32),
                  scores=np.ones(1))  # fmt: skip
    obj = codec.group_to_map(group)
    obj["tokens"]["lengths"] = np.array([2**62, 2**62, 2**62, 2**62 + 3], "<i8").tobytes()  # 3 modulo 2**64
    obj["tokens"]["lengths_dtype"] = "<i8"
    with pytest.raises(InvalidInput):
        codec.unpack_stored_group(msgpack.packb(obj, use_bin_type=True))


def test_error_messages_stay_short_for_huge_values() -> None:
    with pytest.raises(FreeFieldError) as err:
        check_free_fields({"images": [10**5000]})
    assert "of 16610 bits" in err.value.message
    with pytest.raises(FreeFieldError) as err:
        check_free_fields({"images": msgpack.ExtType(1, b"x" * 10_000)})
    assert len(err.value.message) < 300
