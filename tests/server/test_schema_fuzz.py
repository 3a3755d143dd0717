"""Schema fuzzing: requests generated from the published OpenAPI schema (valid and invalid, JSON and msgpack
bodies) against the in-process app must never answer 5xx, and every answer must match the documented status
codes, content types and schemas. Bounded: a few dozen examples per route, no deadline per example."""

from __future__ import annotations

from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra: pip install -e '.[dev]'")

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, reject, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from rollhub.server.factory import create_app  # noqa: E402
from rollhub.server.settings import ServerSettings  # noqa: E402
from rollhub.wire import codec  # noqa: E402
from tests.conftest import registration_body  # noqa: E402

EXAMPLES_PER_ROUTE = 20

REGISTRATION = registration_body(4, num_steps=1000, checkpoint_dir="")

APP = create_app(ServerSettings(storage="memory", max_wait_s=0.05))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    """A trainer that has asked for a batch and two environments (ids 0 and 1), so that env routes can succeed
    too (the fuzzer may change or reset all of it later)."""
    client = TestClient(APP)
    assert client.post("/register", json=REGISTRATION).status_code == 200
    assert client.get("/batch").status_code == 200
    for name in ("a", "b"):
        env = {"max_token_length": 64, "desired_name": name, "weight": 1.0, "group_size": 2}
        assert client.post("/register-env", json=env).json()["status"] == "success"


@schemathesis.serializer(codec.MEDIA_TYPE)
def _msgpack(ctx: Any, value: Any) -> bytes:
    """Generated msgpack bodies: the generated value, msgpack-encoded (str stays str, so packed buffers that
    should be bin are wrong and must be refused with 422). msgpack has no integers past 64 bits: a value
    holding one cannot be sent at all, so that example is dropped."""
    try:
        return codec.packb(value)
    except OverflowError:
        reject()


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_ROUTE,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_server_error_and_every_answer_is_documented(case: Any) -> None:
    case.call_and_validate(checks=CHECKS)


def _rows(draw: Any, lengths: list[int], values: Any, dtype: str, packed: bool) -> Any:
    rows = [draw(st.lists(values, min_size=n, max_size=n)) for n in lengths]
    if not packed:
        return rows
    flat = np.asarray([v for row in rows for v in row], dtype=np.dtype(dtype))
    return {"dtype": dtype, "lengths": np.asarray(lengths, dtype="<i4").tobytes(), "data": flat.tobytes()}


@st.composite
def valid_groups(draw: Any) -> dict[str, Any]:
    """Groups the server must accept, per-token fields as plain lists or as packed msgpack buffers."""
    n = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    packed = draw(st.booleans())
    tokens = st.integers(0, 50_000)
    group = {
        "tokens": _rows(draw, lengths, tokens, "<i4", packed),
        "masks": _rows(draw, lengths, st.integers(-100, 50_000), "<i4", packed),
        "scores": draw(st.lists(st.floats(-1e6, 1e6), min_size=n, max_size=n)),
    }
    if draw(st.booleans()):
        group["inference_logprobs"] = _rows(draw, lengths, st.floats(-30.0, 0.0, width=32), "<f4", packed)
    if draw(st.booleans()):
        group["policy_version"] = draw(st.integers(0, 2**31))
    return group


@settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(groups=st.lists(valid_groups(), min_size=1, max_size=3))
def test_valid_msgpack_groups_are_accepted_and_served_as_documented(groups: list[dict[str, Any]]) -> None:
    """The fuzzer above seldom builds a group whose rows line up; these do, for the msgpack routes, and the
    batches they make are served (JSON and msgpack) as documented."""
    registration = schema["/register"]["POST"].Case(body=REGISTRATION, media_type="application/json")
    assert registration.call_and_validate(checks=CHECKS).status_code == 200
    one = schema["/scored_data"]["POST"].Case(body=groups[0], media_type=codec.MEDIA_TYPE)
    assert one.call_and_validate(checks=CHECKS).status_code == 200
    many = schema["/scored_data_list"]["POST"].Case(body=groups, media_type=codec.MEDIA_TYPE)
    assert many.call_and_validate(checks=CHECKS).status_code == 200
    packed = schema["/batch"]["GET"].Case()
    answer = packed.call_and_validate(
        headers={"Accept": codec.MEDIA_TYPE},
        checks=[not_a_server_error, status_code_conformance, content_type_conformance],
    )
    assert answer.status_code == 200 and answer.headers["content-type"] == [codec.MEDIA_TYPE]
    served = msgpack.unpackb(answer.content)
    assert set(served) == {"batch", "batch_id", "step"}
    batch = schema["/batch"]["GET"].Case()
    answer = batch.call_and_validate(checks=CHECKS)
    assert answer.status_code == 200
