"""Property-based fuzzing of the ingest routes against the serve routes, in-process (fast paths included).

Hostile ``/scored_data`` and ``/scored_data_list`` bodies, JSON and msgpack: every free-form field filled with
nested values, map keys of every msgpack type, bin and ext values, non-finite floats, nesting far past the limit;
per-token fields as plain lists or binary descriptors, some with row lengths that wrap around or disagree with
the data; out-of-range ``policy_version`` and unregistered ``env_id``. For each body:

* the answer is never 5xx; it is 200 exactly when the body is acceptable (judged here from the spec, not from
  the server), otherwise a 4xx whose detail says what is wrong;
* after a 4xx the queue is exactly as before (a group queued earlier is served intact);
* after a 200 the group comes back value-for-value (types and float bits included) from ``/latest_example``, a
  leased JSON ``/batch`` and, after the lease expires, a msgpack ``/batch``; nothing fails to serve.

The default run is bounded (a few hundred bodies); ``pytest -m slow`` runs a long one.
"""

from __future__ import annotations

import datetime
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rollhub.buffer import ExperienceBuffer, make_storage
from rollhub.experience.group import FLOAT_FIELDS, META_FIELDS
from rollhub.server import ServerSettings, create_app
from rollhub.server.storage import GROUP_CODEC
from rollhub.wire import codec
from tests.server.test_extensions import REG

DEPTH_LIMIT = 32
ACCEPT_BIN = {"Accept": codec.MEDIA_TYPE}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Server:
    client: TestClient
    clock: Clock


def make_server(storage: str = "memory") -> Server:
    clock = Clock()
    buf = ExperienceBuffer(make_storage(storage, GROUP_CODEC), clock=clock)
    client = TestClient(create_app(ServerSettings(storage=storage), buffer=buf), raise_server_exceptions=False)
    return Server(client, clock)


# ------------------------------------------------------------------------------------------------- the oracle
def carriable(value: Any, depth: int = 1) -> bool:
    """The spec: what both a JSON and a msgpack answer can carry."""
    if value is None or type(value) in (bool, str):
        return True
    if type(value) is int:
        return -(2**63) <= value <= 2**64 - 1
    if type(value) is float:
        return math.isfinite(value)
    if type(value) is list:
        return depth <= DEPTH_LIMIT and all(carriable(v, depth + 1) for v in value)
    if type(value) is dict:
        return depth <= DEPTH_LIMIT and all(type(k) is str and carriable(v, depth + 1) for k, v in value.items())
    return False


def same(a: Any, b: Any) -> bool:
    """Equal in value and type, floats bit for bit (so -0.0 is not 0.0 and 1 is not 1.0)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if type(a) is list:
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


# ---------------------------------------------------------------------------------------------- the strategies
keys = st.text(max_size=6)
clean_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
clean = st.recursive(
    clean_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3), max_leaves=12
)


def deep(depth: int) -> Any:
    value: Any = "bottom"
    for i in range(depth):
        value = [value] if i % 2 else {"d": value}
    return value


poison = st.one_of(
    st.binary(max_size=6),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
    st.builds(msgpack.Timestamp, st.integers(0, 2**32), st.integers(0, 10**9 - 1)),
    st.builds(lambda v: {1: v}, clean_scalars),
    st.builds(lambda v: {None: v}, clean_scalars),
    st.builds(lambda v: {True: v, "x": 1}, clean_scalars),
    st.builds(lambda v: {2.5: v}, clean_scalars),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.integers(DEPTH_LIMIT, 300).map(deep),
    st.integers(DEPTH_LIMIT, 300).map(lambda n: [deep(n)]),
)


rarely = st.sampled_from([False] * 9 + [True])
sometimes = st.sampled_from([False] * 3 + [True])


@st.composite
def hostile(draw: st.DrawFn) -> Any:
    """A clean value, or (often) a clean value with one poison value buried a few containers deep."""
    value = draw(clean)
    if draw(sometimes):
        bad = draw(poison)
        for _ in range(draw(st.integers(0, 3))):
            bad = draw(st.sampled_from([[value, bad], [bad], {"k": bad, "c": value}]))
        value = bad
    return value


@dataclass
class Spec:
    """One generated request and what the spec says about it."""

    body: bytes
    binary: bool
    many: bool
    n: int
    expected: dict[str, Any] = field(default_factory=dict)  # the served item, arrays as lists
    corrupt: bool = False  # a descriptor that cannot describe the rows (must be refused)
    other_bad: bool = False  # a value outside the wire contract besides the free fields (must be refused)


def _descriptor(rows: list[list[Any]], dtype: str, corruption: str | None) -> dict[str, Any]:
    data = np.concatenate([np.asarray(r, dtype=dtype) for r in rows]) if any(rows) else np.empty(0, dtype)
    lengths: Any = np.asarray([len(r) for r in rows], dtype="<i8")
    out: dict[str, Any] = {"dtype": np.dtype(dtype).str, "data": data.tobytes(), "lengths_dtype": "<i8"}
    total, n = int(lengths.sum()), len(rows)
    same_rows = [2**63 - 1, 2**63 - 1, total + 2] + [0] * (n - 3)  # n rows summing to total modulo 2**64
    if corruption == "wrap" and n >= 3:
        lengths = np.asarray(same_rows, dtype="<i8")
    elif corruption == "list-wrap" and n >= 3:
        lengths = same_rows
    elif corruption == "wrap":  # huge lengths summing to the data size modulo 2**64
        lengths = np.append(lengths, [2**62, 2**62, 2**62, 2**62]).astype("<i8")
    elif corruption == "negative":
        lengths = np.append(lengths, [-5, 5]).astype("<i8")
    elif corruption == "list-wrap":
        lengths = [*map(int, lengths), 2**63 - 1, 2**63 - 1, 2]
    elif corruption == "short":
        lengths = np.append(lengths, [1]).astype("<i8")
    elif corruption == "odd-bytes":
        out["data"] += b"\x00"
    out["lengths"] = lengths if isinstance(lengths, list) else lengths.tobytes()
    return out


CORRUPTIONS = [None] * 10 + ["wrap", "negative", "list-wrap", "short", "odd-bytes"]


@st.composite
def requests(draw: st.DrawFn, binary: bool) -> Spec:
    n = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    token = st.integers(-(2**31), 2**31 - 1) | st.sampled_from([-(2**63), 2**63 - 1])
    tokens = [draw(st.lists(token, min_size=k, max_size=k)) for k in lengths]
    masks = [draw(st.lists(st.integers(-100, 5), min_size=k, max_size=k)) for k in lengths]
    finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
    scores = draw(st.lists(finite, min_size=n, max_size=n))
    if draw(rarely):
        scores[draw(st.integers(0, n - 1))] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    obj: dict[str, Any] = {"tokens": tokens, "masks": masks, "scores": scores}
    spec = Spec(b"", binary, draw(st.booleans()), n)
    spec.other_bad = not all(math.isfinite(s) for s in scores)
    expected: dict[str, Any] = {"tokens": tokens, "masks": masks, "scores": [float(s) for s in scores]}
    for name in FLOAT_FIELDS:
        if draw(st.booleans()):
            rows = [draw(st.lists(finite, min_size=k, max_size=k)) for k in lengths]
            obj[name] = expected[name] = rows
    meta = {
        "generation_params": st.dictionaries(keys, hostile(), max_size=3),
        "group_overrides": st.dictionaries(keys | st.integers(0, 2) | st.none(), hostile(), max_size=2),
        "images": hostile(),
        "overrides": st.lists(st.dictionaries(keys, hostile(), max_size=2), min_size=n, max_size=n),
        "messages": st.lists(st.builds(lambda c: [{"role": "user", "content": c}], hostile()), min_size=n, max_size=n),
        "distill_token_ids": st.lists(
            st.lists(st.lists(st.integers(-(2**63), 2**64 - 1), max_size=2), max_size=2), min_size=n, max_size=n
        ),
        "distill_logprobs": st.lists(st.lists(st.lists(finite, max_size=2), max_size=2), min_size=n, max_size=n),
    }
    for name, strategy in meta.items():
        if draw(st.booleans()):
            obj[name] = draw(strategy)
    if obj.get("distill_logprobs") and obj["distill_logprobs"][0] and obj["distill_logprobs"][0][0] and draw(rarely):
        obj["distill_logprobs"][0][0][0] = float("nan")  # JSON cannot carry it at all; msgpack can, and is refused
    if draw(st.booleans()):
        bad_version = draw(rarely)
        obj["policy_version"] = draw(st.sampled_from([-1, 2**63]) if bad_version else st.integers(0, 2**63 - 1))
        spec.other_bad |= not 0 <= obj["policy_version"] < 2**63
    if draw(rarely):
        obj["env_id"] = draw(st.integers(0, 3))  # no env is registered: refused
        spec.other_bad = True
    if binary:
        # one corruption shared by every per-token field keeps their shapes in agreement: only the strict
        # descriptor checks can catch it
        shared = draw(st.sampled_from(["wrap", "list-wrap", "negative"])) if draw(sometimes) else None
        for name in ("tokens", "masks", *FLOAT_FIELDS):
            if name in obj and (shared is not None or draw(st.booleans())):
                corruption = shared or draw(st.sampled_from(CORRUPTIONS))
                dtype = "<i8" if name in ("tokens", "masks") else "<f4"
                obj[name] = _descriptor(obj[name], dtype, corruption)
                spec.corrupt |= corruption is not None
        if draw(st.booleans()):
            data = np.asarray(scores, dtype="<f8").tobytes()
            cut = draw(st.sampled_from([None] * 6 + ["odd-bytes", "one-short"]))
            obj["scores"] = {
                "dtype": "<f8",
                "data": data + b"\x00" if cut == "odd-bytes" else data[: -8 if cut else None],
            }
            spec.corrupt |= cut is not None
    spec.body = _encode(obj, binary, spec.many)
    spec.expected = expected
    return spec


def _encode(obj: dict[str, Any], binary: bool, many: bool) -> bytes:
    payload: Any = [obj] if many else obj
    if binary:
        try:
            return msgpack.packb(payload, use_bin_type=True, datetime=True)
        except (OverflowError, ValueError, TypeError):  # a 65-bit integer: msgpack cannot send it; drop the field
            return msgpack.packb(_drop_unsendable(payload), use_bin_type=True, datetime=True)
    return json.dumps(payload, default=lambda o: o.hex() if isinstance(o, bytes) else repr(o)).encode()


def _drop_unsendable(payload: Any) -> Any:
    items = payload if isinstance(payload, list) else [payload]
    for obj in items:
        for name in list(obj):
            try:
                msgpack.packb(obj[name], use_bin_type=True, datetime=True)
            except (OverflowError, ValueError, TypeError):
                del obj[name]
    return payload


def parsed_group(spec: Spec) -> dict[str, Any] | None:
    """The group as the server's parser reads the body (None if it is not even valid JSON/msgpack)."""
    try:
        obj = msgpack.unpackb(spec.body, raw=False, strict_map_key=False) if spec.binary else orjson.loads(spec.body)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    return obj[0] if spec.many else obj


# ------------------------------------------------------------------------------------------------- the checks
def start(server: Server, n: int) -> dict[str, Any]:
    """A fresh run with batch size ``n`` and one sentinel group of ``n`` sequences queued; the status."""
    c = server.client
    assert c.get("/reset_data").status_code == 200
    assert c.post("/register", json={**REG, "batch_size": n}).status_code == 200
    sentinel = {"tokens": [[7, i] for i in range(n)], "masks": [[-100, i] for i in range(n)], "scores": [0.5] * n}
    assert c.post("/scored_data", json=sentinel).status_code == 200
    return c.get("/status").json()


def served_msgpack(group_map: dict[str, Any]) -> dict[str, Any]:
    arrays = codec.map_to_arrays(group_map)
    out = dict(group_map)
    for name in ("tokens", "masks", *FLOAT_FIELDS):
        if arrays.get(name) is not None:
            out[name] = [r.tolist() for r in arrays[name]]
    out["scores"] = np.asarray(arrays["scores"]).tolist()
    return out


def assert_served(item: dict[str, Any], spec: Spec, parsed: dict[str, Any], where: str) -> None:
    for name, value in spec.expected.items():
        assert same(item[name], value), (where, name, item[name], value)
    for name in FLOAT_FIELDS:
        if name not in spec.expected:
            assert item[name] is None, (where, name)
    for name in META_FIELDS:
        assert same(item[name], parsed.get(name)), (where, name, item[name], parsed.get(name))
    assert item.get("policy_version") == parsed.get("policy_version") and item["env_id"] is None, where


def _where(answer: Any) -> str:
    detail = answer.get("detail")
    loc = detail[0].get("loc", ["?"]) if isinstance(detail, list) and detail else ["?"]
    return str(next((x for x in loc[1:] if isinstance(x, str)), "body"))


def ok(c: TestClient, path: str, **kwargs: Any) -> Any:
    """GET ``path``, which must answer 200 (never a 5xx while serving what was accepted)."""
    answer = c.get(path, **kwargs)
    assert answer.status_code == 200, (path, answer.status_code, answer.text[:300])
    return answer


def check(server: Server, spec: Spec) -> None:
    c = server.client
    before = start(server, spec.n)
    route = "/scored_data_list" if spec.many else "/scored_data"
    ctype = codec.MEDIA_TYPE if spec.binary else "application/json"
    answer = c.post(route, content=spec.body, headers={"Content-Type": ctype})
    assert answer.status_code < 500, answer.text
    parsed = parsed_group(spec)
    acceptable = (
        parsed is not None
        and not spec.corrupt
        and not spec.other_bad
        and all(carriable(parsed.get(name)) for name in META_FIELDS)
    )
    kind = "accepted" if answer.status_code == 200 else f"refused at {_where(answer.json())}"
    event(f"{kind} ({'msgpack' if spec.binary else 'JSON'})")
    if not acceptable or answer.status_code != 200:
        assert not acceptable, ("an acceptable body was refused", answer.status_code, answer.text[:500])
        assert 400 <= answer.status_code < 500 and answer.json()["detail"], answer.text[:300]
        assert ok(c, "/status").json() == before, "a refused body changed the queue"
        assert ok(c, "/batch").json()["batch"][0]["tokens"][0] == [7, 0]
        return
    assert ok(c, "/status").json()["queue_size"] == before["queue_size"] + 1
    assert parsed is not None
    assert_served(ok(c, "/latest_example").json(), spec, parsed, "latest_example")
    assert ok(c, "/batch").json()["batch"][0]["tokens"][0] == [7, 0]  # the sentinel, untouched
    leased = ok(c, "/batch", params={"lease_s": 30}).json()
    assert_served(leased["batch"][0], spec, parsed, "leased JSON batch")
    server.clock.now += 60  # never acknowledged: served again, here as msgpack
    again = msgpack.unpackb(ok(c, "/batch", headers=ACCEPT_BIN).content)
    assert again["step"] == leased["step"]
    assert_served(served_msgpack(again["batch"][0]), spec, parsed, "msgpack batch")
    status = ok(c, "/status").json()
    assert (status["queue_size"], status["leased_batches"], status["serve_failures"]) == (0, 0, 0)


MEMORY = make_server()
FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(spec=requests(binary=True))
def test_msgpack_bodies_are_refused_or_served_intact(spec: Spec) -> None:
    check(MEMORY, spec)


@FUZZ
@given(spec=requests(binary=False))
def test_json_bodies_are_refused_or_served_intact(spec: Spec) -> None:
    check(MEMORY, spec)


def test_sqlite_backend_serves_what_it_accepted(tmp_path: Any) -> None:
    server = make_server(f"sqlite:///{tmp_path}/fuzz.db")

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(spec=requests(binary=True) | requests(binary=False))
    def run(spec: Spec) -> None:
        check(server, spec)

    with server.client:
        run()


@pytest.mark.slow
def test_long_ingest_fuzz(request: pytest.FixtureRequest) -> None:
    """Thousands of bodies; runs only when the slow tests are selected (``pytest -m slow``)."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the long ingest fuzz runs with: pytest -m slow tests/server/test_ingest_fuzz.py")

    @settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
    @given(spec=requests(binary=True) | requests(binary=False))
    def run(spec: Spec) -> None:
        check(MEMORY, spec)

    run()


def test_the_oracle_matches_the_issue() -> None:
    assert not carriable({1: "x"}) and not carriable({None: 1}) and not carriable(b"x")
    assert not carriable(msgpack.Timestamp.from_datetime(datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)))
    assert not carriable(deep(DEPTH_LIMIT + 1)) and carriable(deep(DEPTH_LIMIT))
    assert not same(1, 1.0) and not same(0.0, -0.0) and same([{"a": 1.5}], [{"a": 1.5}])
