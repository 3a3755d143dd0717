"""Conversion of Atropos ``ScoredData`` JSON to the compact Group and back.

Covers the exact JSON round trip (ints, floats not representable in float32, ``[]`` and ``{}`` as given,
unset optionals as null, the 14 item keys in 0.4.0's order), float32 narrowing only when lossless, the
int64 fallback, shape errors that name field and index, and type errors worded by pydantic.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rollhub.errors import InvalidInput
from rollhub.experience.group import Group
from rollhub.server.errors import http_status
from rollhub.wire.group import group_from_json, group_to_item
from rollhub.wire.models import ITEM_KEYS

ORDER_0_4_0 = (
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "inference_logprobs",
    "overrides",
    "group_overrides",
    "images",
    "env_id",
    "distill_token_ids",
    "distill_logprobs",
)


def served(group: Group) -> dict[str, Any]:
    """The item as the server sends it: orjson with numpy support, parsed back."""
    return orjson.loads(orjson.dumps(group_to_item(group), option=orjson.OPT_SERIALIZE_NUMPY))


def body(**fields: Any) -> dict[str, Any]:
    """A valid two-sequence ScoredData body, with ``fields`` replacing or adding keys."""
    out: dict[str, Any] = {
        "tokens": [[1, 2, 3], [4, 5]],
        "masks": [[-100, 2, 3], [-100, 5]],
        "scores": [1.0, -0.5],
    }
    out.update(fields)
    return out


def wire(obj: Any) -> Any:
    """What the server parses from a client's JSON text."""
    return json.loads(json.dumps(obj))


def test_item_has_the_14_keys_in_0_4_0_order() -> None:
    assert ITEM_KEYS == ORDER_0_4_0
    item = group_to_item(group_from_json(wire(body())))
    assert tuple(item) == ORDER_0_4_0
    assert tuple(served(group_from_json(wire(body())))) == ORDER_0_4_0


def test_policy_version_is_appended_only_when_set() -> None:
    assert "policy_version" not in group_to_item(group_from_json(wire(body())))
    item = served(group_from_json(wire(body(policy_version=4))))
    assert tuple(item)[:14] == ORDER_0_4_0 and item["policy_version"] == 4


def test_unset_optionals_come_back_null() -> None:
    item = served(group_from_json(wire(body())))
    for key in ORDER_0_4_0[3:]:
        assert item[key] is None, key


def test_empty_list_and_empty_dict_round_trip_as_given() -> None:
    sent = body(
        advantages=[],
        ref_logprobs=[],
        inference_logprobs=[],
        messages=[],
        generation_params={},
        overrides=[],
        group_overrides={},
        images=[],
        distill_token_ids=[],
        distill_logprobs=[],
    )
    item = served(group_from_json(wire(sent)))
    for key, value in sent.items():
        assert item[key] == value and type(item[key]) is type(value), key
    assert served(group_from_json(wire(body(images={}))))["images"] == {}


def test_full_body_round_trips_exactly() -> None:
    sent = body(
        advantages=[[0.1, 0.2, 0.3], [1.0, 2.0]],
        ref_logprobs=[[-0.5, -0.25, -1e-300], [-3.0, 0.0]],
        inference_logprobs=[[1.0, -0.123456789012345, -2.5], [1.0, -7.0]],
        messages=[[{"role": "user", "content": "hi", "extra": 1}], [{"role": "assistant", "content": "x"}]],
        generation_params={"temperature": 0.7, "nested": {"a": [1, 2]}},
        overrides=[{"set_advantage_to_zero": True}, {}],
        group_overrides={"group_size": 2},
        images=["data:image/png;base64,AAAA", None],
        env_id=3,
        distill_token_ids=[[[1, 2]], [[3]]],
        distill_logprobs=[[[-0.1, -0.2]], [[-0.3]]],
    )
    item = served(group_from_json(wire(sent)))
    for key, value in sent.items():
        assert item[key] == value, key


def test_large_ints_round_trip_through_the_int64_fallback() -> None:
    sent = body(tokens=[[2**40, -(2**62), 3], [2**63 - 1, 0]])
    group = group_from_json(wire(sent))
    assert group.tokens.data.dtype == np.int64
    assert served(group)["tokens"] == sent["tokens"]


def test_ints_that_fit_are_stored_as_int32() -> None:
    group = group_from_json(wire(body(tokens=[[2**31 - 1, -(2**31), 0], [1, 2]])))
    assert group.tokens.data.dtype == np.int32 and group.masks.data.dtype == np.int32


def test_ints_over_int64_are_refused() -> None:
    with pytest.raises(InvalidInput) as err:
        group_from_json(wire(body(tokens=[[2**64, 1, 2], [1, 2]])))
    assert err.value.field == "tokens"
    with pytest.raises(InvalidInput):
        group_from_json(wire(body(tokens=[[-1, 2**63, 2], [1, 2]])))


def test_float32_only_when_lossless() -> None:
    exact = group_from_json(wire(body(ref_logprobs=[[0.5, -0.25, 1.0], [-2.0, 3.5]])))
    assert exact.ref_logprobs is not None and exact.ref_logprobs.data.dtype == np.float32
    lossy = group_from_json(wire(body(ref_logprobs=[[0.5, -0.25, 1.0], [0.1, 3.5]])))
    assert lossy.ref_logprobs is not None and lossy.ref_logprobs.data.dtype == np.float64
    assert served(lossy)["ref_logprobs"] == [[0.5, -0.25, 1.0], [0.1, 3.5]]
    for value in (1e-45, 3.4028235677973366e38 * 2, 2.0**-150, 16777217.0):  # below, over, between f32
        group = group_from_json(wire(body(advantages=[[value, 0.0, 0.0], [0.0, 0.0]])))
        assert served(group)["advantages"][0][0] == value


def test_negative_zero_keeps_its_sign() -> None:
    item = served(group_from_json(wire(body(inference_logprobs=[[-0.0, 1.0, 1.0], [1.0, 1.0]]))))
    assert str(item["inference_logprobs"][0][0]) == "-0.0"


FINITE = st.floats(allow_nan=False, allow_infinity=False)
INT64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5))
    ints = st.one_of(st.integers(-100, 50_000), INT64)

    def rows(values: st.SearchStrategy[Any]) -> list[list[Any]]:
        return [draw(st.lists(values, min_size=n, max_size=n)) for n in lengths]

    out: dict[str, Any] = {
        "tokens": rows(ints),
        "masks": rows(ints),
        "scores": draw(st.lists(FINITE, min_size=len(lengths), max_size=len(lengths))),
    }
    for name in ("advantages", "ref_logprobs", "inference_logprobs"):
        choice = draw(st.sampled_from(["unset", "null", "empty", "rows"]))
        if choice == "null":
            out[name] = None
        elif choice == "empty":
            out[name] = []
        elif choice == "rows":
            out[name] = rows(st.one_of(FINITE, st.floats(width=32, allow_nan=False, allow_infinity=False)))
    return out


@settings(max_examples=150, deadline=None)
@given(bodies())
def test_json_round_trip_is_exact(sent: dict[str, Any]) -> None:
    item = served(group_from_json(wire(sent)))
    for key in ORDER_0_4_0:
        expected = sent.get(key)
        if key == "scores":
            expected = [float(x) for x in expected]  # type: ignore[union-attr]
        assert item[key] == expected, key


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("fields", "field", "index"),
    [
        ({"masks": [[-100, 2, 3], [-100]]}, "masks", 1),
        ({"masks": [[-100, 2, 3]]}, "masks", None),
        ({"scores": [1.0]}, "scores", None),
        ({"scores": [1.0, float("nan")]}, "scores", 1),
        ({"scores": [float("inf"), 1.0]}, "scores", 0),
        ({"advantages": [[1.0, 2.0, 3.0], [1.0]]}, "advantages", 1),
        ({"ref_logprobs": [[1.0, 2.0]]}, "ref_logprobs", None),
        ({"inference_logprobs": [[1.0, 2.0, 3.0, 4.0], [1.0, 2.0]]}, "inference_logprobs", 0),
        ({"inference_logprobs": [[1.0, 2.0, 3.0], [1.0, float("nan")]]}, "inference_logprobs", 1),
        ({"ref_logprobs": [[1.0, 2.0, 3.0], [float("-inf"), 1.0]]}, "ref_logprobs", 1),
        ({"messages": [[{"role": "user", "content": "x"}]]}, "messages", None),
        ({"overrides": [{}, {}, {}]}, "overrides", None),
        ({"policy_version": -1}, "policy_version", None),
        ({"policy_version": 2**63}, "policy_version", None),
        ({"tokens": [], "masks": [], "scores": []}, "tokens", None),
    ],
)
def test_shape_errors_name_field_and_index(fields: dict[str, Any], field: str, index: int | None) -> None:
    with pytest.raises(InvalidInput) as err:
        group_from_json(wire(body(**fields)))
    assert (err.value.field, err.value.index) == (field, index)
    assert http_status(err.value) == 422
    assert field in err.value.message
    assert err.value.detail()[0]["loc"] == ["body", field] + ([] if index is None else [index])


def test_infinite_logprob_from_python_json_is_refused() -> None:
    # Python's json module emits -Infinity; served back as JSON it could only become null.
    parsed = json.loads('{"tokens": [[1]], "masks": [[1]], "scores": [0.0], "ref_logprobs": [[-Infinity]]}')
    with pytest.raises(InvalidInput) as err:
        group_from_json(parsed)
    assert (err.value.field, err.value.index) == ("ref_logprobs", 0)


@pytest.mark.parametrize(
    ("obj", "loc"),
    [
        (body(tokens=[["a", 2, 3], [4, 5]]), ("tokens", 0, 0)),
        (body(tokens=[[1.5, 2, 3], [4, 5]]), ("tokens", 0, 0)),
        (body(tokens=[[1, None, 3], [4, 5]]), ("tokens", 0, 1)),
        (body(tokens="abc"), ("tokens",)),
        (body(scores=["x", 1.0]), ("scores", 0)),
        (body(advantages=[[1.0, "a", 2.0], [1.0, 1.0]]), ("advantages", 0, 1)),
        (body(messages=[[{"role": "user"}], [{"role": "user", "content": "x"}]]), ("messages",)),
        (body(generation_params=[1, 2]), ("generation_params",)),
        (body(env_id="zero"), ("env_id",)),
        ({"tokens": [[1]], "masks": [[1]]}, ("scores",)),
        ([1, 2, 3], ()),
    ],
)
def test_type_errors_raise_pydantic_validation_error(obj: Any, loc: tuple[Any, ...]) -> None:
    with pytest.raises(ValidationError) as err:
        group_from_json(obj)
    assert tuple(err.value.errors()[0]["loc"]) == loc


def test_unknown_fields_are_ignored() -> None:
    item = served(group_from_json(wire(body(something_new=[1, 2], another={"a": 1}))))
    assert "something_new" not in item and item["tokens"] == [[1, 2, 3], [4, 5]]


def test_lax_values_are_accepted_as_0_4_0_does() -> None:
    # pydantic (and so 0.4.0) accepts a whole float for an int and an int for a float
    item = served(group_from_json(wire(body(tokens=[[1.0, 2, 3], [4, 5]], scores=[1, 2]))))
    assert item["tokens"] == [[1, 2, 3], [4, 5]] and item["scores"] == [1.0, 2.0]


def test_compacted_group_is_equal_and_lives_in_one_mapping() -> None:
    import mmap

    import numpy as np

    from rollhub.buffer import MemoryStorage
    from rollhub.buffer.storage import Entry, Transaction
    from rollhub.wire.group import group_from_json

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 50_000, size=3000).tolist() for _ in range(4)]
    group = group_from_json(
        {
            "tokens": rows,
            "masks": rows,
            "scores": [1.0, 0.0, 1.0, 0.5],
            "inference_logprobs": [[-0.5] * 3000 for _ in rows],
            "env_id": None,
            "policy_version": 3,
        }
    )
    small = group_from_json({"tokens": [[1]], "masks": [[1]], "scores": [1.0]})
    assert small.compacted() is small
    storage = MemoryStorage()
    storage.apply(Transaction(puts=[(Entry(1, 4), group, "queued", 1.0)]))
    stored = storage.payloads([1])[0]
    assert stored is not group
    assert group_to_item(stored).keys() == group_to_item(group).keys()
    for name in ("tokens", "masks", "inference_logprobs"):
        np.testing.assert_array_equal(getattr(stored, name).data, getattr(group, name).data)
        np.testing.assert_array_equal(getattr(stored, name).offsets, getattr(group, name).offsets)
    np.testing.assert_array_equal(stored.scores, group.scores)
    assert stored.policy_version == 3
    bases = {
        id(a.base.obj) if isinstance(a.base, memoryview) else id(a.base)
        for a in (stored.scores, stored.tokens.data, stored.masks.data, stored.inference_logprobs.data)
    }
    assert len(bases) == 1
    assert isinstance(stored.tokens.data.base, mmap.mmap | memoryview)


def test_a_group_pickles_without_its_wire_view() -> None:
    import pickle

    import orjson

    group = group_from_json({"tokens": [[1, 2]], "masks": [[1, 2]], "scores": [1.0], "env_id": 3})
    group.wire = memoryview(b"the body it came from")  # a view of this process's memory cannot travel
    back = pickle.loads(pickle.dumps(group))
    assert back.wire is None and back.env_id == 3 and back.tokens.data.tolist() == [1, 2]
    as_json = orjson.OPT_SERIALIZE_NUMPY
    assert orjson.dumps(group_to_item(back), option=as_json) == orjson.dumps(group_to_item(group), option=as_json)
