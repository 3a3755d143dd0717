"""The simdjson path gives exactly the general path's group, or steps aside (None) so the general path answers."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rollhub.errors import InvalidInput
from rollhub.wire.fastjson import parse_groups
from rollhub.wire.group import group_from_json, group_to_item

NUMPY = orjson.OPT_SERIALIZE_NUMPY


def general(obj: Any, many: bool) -> list[bytes] | None:
    try:
        groups = [group_from_json(o) for o in obj] if many else [group_from_json(obj)]
    except (InvalidInput, ValidationError):
        return None
    return [orjson.dumps(group_to_item(g), option=NUMPY) for g in groups]


def fast(body: bytes, many: bool) -> list[bytes] | None:
    groups = parse_groups(body, many=many)
    return None if groups is None else [orjson.dumps(group_to_item(g), option=NUMPY) for g in groups]


ints = st.integers(-(2**40), 2**40) | st.sampled_from([-100, 0, 2**31, -(2**63), 2**63 - 1])
numbers = st.floats(allow_nan=False, allow_infinity=False, width=32) | st.floats(allow_nan=False, allow_infinity=False)
odd = st.sampled_from([2.0, 2.5, "3", True, None, [4], [], 2**64, {"a": 1}])
int_row = st.lists(ints | odd, max_size=5)
float_row = st.lists(numbers | odd, max_size=5)
strings = st.text(alphabet='ab[]{},"', max_size=6)
group = st.fixed_dictionaries(
    {
        "tokens": st.lists(int_row, min_size=0, max_size=3),
        "masks": st.lists(int_row, max_size=3),
        "scores": st.lists(numbers | odd, max_size=3),
    },
    optional={
        "inference_logprobs": st.none() | st.lists(float_row, max_size=3),
        "advantages": st.none() | st.lists(float_row, max_size=3),
        "messages": st.lists(
            st.lists(st.fixed_dictionaries({"role": strings, "content": strings}), max_size=2), max_size=3
        ),
        "generation_params": st.dictionaries(strings, strings | ints, max_size=2),
        "env_id": st.none() | st.integers(-2, 2),
        "policy_version": st.none() | st.integers(-2, 5) | odd,
        "images": strings | st.lists(strings, max_size=2),
        "unknown[": st.lists(ints, max_size=2),
    },
)


def consistent_group(draw_n: int) -> st.SearchStrategy[dict[str, Any]]:
    rows = st.lists(st.lists(ints, min_size=1, max_size=4), min_size=draw_n, max_size=draw_n)
    return rows.flatmap(
        lambda toks: st.fixed_dictionaries(
            {
                "tokens": st.just(toks),
                "masks": st.just([[t % 7 for t in r] for r in toks]),
                "scores": st.lists(numbers, min_size=len(toks), max_size=len(toks)),
            },
            optional={"inference_logprobs": st.just([[-0.5 * i for i in range(len(r))] for r in toks])},
        )
    )


@settings(max_examples=300, deadline=None, derandomize=True)
@given(obj=group | st.integers(1, 3).flatmap(consistent_group), many=st.booleans())
def test_fast_path_equals_general_path_or_steps_aside(obj: dict[str, Any], many: bool) -> None:
    payload = [obj, obj] if many else obj
    body = json.dumps(payload).encode()
    expected = general(payload, many)
    got = fast(body, many)
    # Stepping aside (None) is always allowed: the general path then answers. A fast answer must be the general
    # path's answer, and a body the general path refuses must never get one.
    if got is not None:
        assert got == expected


@settings(max_examples=100, deadline=None, derandomize=True)
@given(obj=st.integers(1, 4).flatmap(consistent_group))
def test_well_formed_groups_take_the_fast_path(obj: dict[str, Any]) -> None:
    body = orjson.dumps(obj)
    got = fast(body, False)
    assert got is not None and got == general(obj, False)


@pytest.mark.parametrize(
    "body",
    [
        b'{"tokens": [[1, [2]]], "masks": [[1, 2]], "scores": [1]}',  # a nested one-element array
        b'{"tokens": [[[1], 2]], "masks": [[1, 2]], "scores": [1]}',
        b'{"tokens": [[1, 2]], "masks": [[1, 2]], "scores": [[1]]}',
        b'{"tokens": [[1, 2]], "masks": [[1, 2]], "scores": [1], "inference_logprobs": [[0.5, [1.0]]]}',
        b'{"tokens": [[1, 99999999999999999999999]], "masks": [[1, 2]], "scores": [1]}',  # past 64 bits
    ],
)
def test_nested_arrays_are_never_flattened(body: bytes) -> None:
    assert parse_groups(body, many=False) is None
    with pytest.raises((ValidationError, InvalidInput)):
        group_from_json(json.loads(body))


@pytest.mark.parametrize(
    "body",
    [
        b'{"\\u0000": null, "tokens": [[1, 2]], "masks": [[1, 2]], "scores": [1.0]}',  # a key simdjson cannot look up
        b'{"tokens": [[1, 2]], "tokens": [[3, 4]], "masks": [[1, 2]], "scores": [1.0]}',  # a repeated key
        b'{"\\u0000": null}',
    ],
)
def test_odd_keys_give_what_the_general_parser_gives(body: bytes) -> None:
    parsed = parse_groups(body, many=False)
    try:
        expected = group_from_json(orjson.loads(body))
    except (ValidationError, InvalidInput):
        assert parsed is None
        return
    assert parsed is None or group_to_item(parsed[0]) == group_to_item(expected)
    if parsed is None:
        assert expected.tokens.data.tolist() in ([1, 2], [3, 4])


def test_a_parser_still_in_use_is_not_reused() -> None:
    from rollhub.wire import fastjson

    alive = fastjson._parse(b'{"held": [1, 2, 3]}')  # a document of this thread's cached parser, still referenced
    body = b'{"tokens": [[5, 6]], "masks": [[5, 6]], "scores": [1.0]}'
    parsed = parse_groups(body, many=False)
    assert parsed is not None and parsed[0].tokens.data.tolist() == [5, 6]
    assert alive["held"][2] == 3, "the earlier document is intact"
    del alive
    again = parse_groups(body, many=False)  # and the cached parser is usable once that document is gone
    assert again is not None
