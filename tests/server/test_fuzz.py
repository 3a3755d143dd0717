"""Bounded fuzzing of every route in-process: whatever a client sends, the answer is never a 5xx."""

from __future__ import annotations

import gzip
import json

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollhub.server import ServerSettings, create_app
from tests.conftest import registration_body

APP = create_app(ServerSettings(storage="memory", max_body_bytes=64 * 1024))
CLIENT = TestClient(APP, raise_server_exceptions=False)
REG = registration_body(4)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=5)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)
rows = st.lists(st.lists(st.integers(-200, 2**40), max_size=5), max_size=4)
float_rows = st.lists(st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=5), max_size=4)
scored = st.fixed_dictionaries(
    {"tokens": rows, "masks": rows, "scores": st.lists(st.floats(allow_nan=False), max_size=4)},
    optional={
        "inference_logprobs": float_rows,
        "advantages": float_rows,
        "env_id": st.integers(-3, 3) | st.none(),
        "policy_version": st.integers(-3, 3) | st.none(),
        "messages": json_values,
        "overrides": json_values,
        "generation_params": json_values,
    },
)
bodies = st.one_of(scored, st.lists(scored, max_size=3), json_values).map(lambda v: json.dumps(v).encode()) | st.binary(
    max_size=200
)
POSTS = ["/register", "/register-env", "/disconnect-env", "/scored_data", "/scored_data_list", "/ack"]
GETS = ["/", "/status", "/info", "/wandb_info", "/status-env", "/batch", "/latest_example", "/health", "/metrics"]


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(POSTS),
    body=bodies,
    content_type=st.sampled_from(["application/json", "application/msgpack", "text/plain"]),
    gzipped=st.booleans(),
    register_first=st.booleans(),
)
def test_posts_never_answer_5xx(path: str, body: bytes, content_type: str, gzipped: bool, register_first: bool) -> None:
    if register_first:
        CLIENT.post("/register", json=REG)
        CLIENT.get("/batch")
    headers = {"Content-Type": content_type}
    if gzipped:
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    answer = CLIENT.post(path, content=body, headers=headers)
    assert answer.status_code < 500, (path, answer.status_code, answer.text[:300])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    path=st.sampled_from(GETS),
    params=st.dictionaries(
        st.sampled_from(["env_id", "wait_s", "lease_s"]), st.sampled_from(["0", "-1", "1e9", "x", "0.01", "7"])
    ),
    body=st.none() | bodies,
    reset_first=st.booleans(),
)
def test_gets_never_answer_5xx(path: str, params: dict[str, str], body: bytes | None, reset_first: bool) -> None:
    if reset_first:
        CLIENT.get("/reset_data")
    params.pop("wait_s", None) if params.get("wait_s") == "1e9" else None
    answer = CLIENT.request("GET", path, params=params, content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code < 500, (path, params, answer.status_code, answer.text[:300])
