"""rollhub's extensions over HTTP: long-poll, backpressure, staleness, leases, API keys, msgpack bodies."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from fastapi.testclient import TestClient

from rollhub.buffer import BufferConfig, ExperienceBuffer, make_storage
from rollhub.experience.group import Ragged
from rollhub.server import ServerSettings, create_app
from rollhub.server.factory import flat_routes
from rollhub.server.middleware import DOC_PATHS, OPEN_PATHS
from rollhub.wire import codec
from rollhub.wire.group import group_from_json
from tests.conftest import ServerProcess, registration_body

REG = registration_body(8)


def group(tag: int, n: int = 4, version: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "tokens": [[tag, i, 9] for i in range(n)],
        "masks": [[-100, i, 9] for i in range(n)],
        "scores": [1.0] * n,
        "inference_logprobs": [[1.0, -0.5, -0.1 * (i + 1)] for i in range(n)],
    }
    if version is not None:
        body["policy_version"] = version
    return body


def tags(batch: list[dict[str, Any]]) -> list[int]:
    return [item["tokens"][0][0] for item in batch]


def client_for(**settings: Any) -> TestClient:
    return TestClient(create_app(ServerSettings(storage="memory", **settings)))


def test_long_poll_wakes_when_data_arrives(server_factory: type[ServerProcess]) -> None:
    server = server_factory("--storage", "memory").start()
    result: dict[str, Any] = {}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        c.post("/register", json=REG)
        assert c.get("/batch", params={"wait_s": 0.2}).json() == {"batch": None}  # times out empty

        def waiter() -> None:
            with httpx.Client(base_url=server.url, timeout=30) as w:
                result["answer"] = w.get("/batch", params={"wait_s": 20}).json()

        t = threading.Thread(target=waiter)
        t.start()
        c.post("/scored_data", json=group(1))
        assert t.is_alive()  # one group is not a batch yet: the poll keeps waiting
        c.post("/scored_data", json=group(2))
        t.join(25)
    assert tags(result["answer"]["batch"]) == [1, 2]


def test_queue_bound_answers_429_and_recovers_after_a_drain() -> None:
    with client_for(max_queued_sequences=8, retry_after_s=2) as c:
        c.post("/register", json=REG)
        assert c.post("/scored_data", json=group(1)).status_code == 200
        assert c.post("/scored_data", json=group(2)).status_code == 200
        refused = c.post("/scored_data", json=group(3))
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "2"
        assert "bound is 8" in refused.json()["detail"][0]["msg"]
        assert c.post("/scored_data_list", json=[group(4)]).status_code == 429
        status = c.get("/status").json()
        assert status["queued_sequences"] == 8 and status["max_queued_sequences"] == 8
        assert tags(c.get("/batch").json()["batch"]) == [1, 2]  # nothing accepted was evicted
        assert c.post("/scored_data", json=group(5)).status_code == 200
        assert "rollhub_refused_full_total 2" in c.get("/metrics").text


def test_stale_groups_are_never_served_and_are_counted() -> None:
    with client_for(max_staleness=1) as c:
        c.post("/register", json=REG)
        c.post("/scored_data_list", json=[group(1, version=0), group(2, version=0)])
        assert tags(c.get("/batch").json()["batch"]) == [1, 2]  # step 0: fresh
        c.post("/scored_data_list", json=[group(3, version=0), group(4, version=1), group(5, version=1)])
        assert tags(c.get("/batch").json()["batch"]) == [3, 4]  # step 1: version 0 is 1 behind, still allowed
        c.post("/scored_data", json=group(6, version=0))  # step 2: version 0 is 2 behind
        c.post("/scored_data", json=group(7, version=2))
        assert tags(c.get("/batch").json()["batch"]) == [5, 7]
        status = c.get("/status").json()
        assert status["stale_dropped"] == {"None": 1}
        assert 'rollhub_stale_dropped_total{env_id="None",env="(no env)"} 1' in c.get("/metrics").text


def test_leased_batch_comes_back_after_expiry_and_never_after_ack() -> None:
    now = [1000.0]
    buffer = ExperienceBuffer(make_storage("memory"), BufferConfig(), clock=lambda: now[0])
    with TestClient(create_app(ServerSettings(storage="memory"), buffer=buffer)) as c:
        c.post("/register", json=REG)
        c.post("/scored_data_list", json=[group(t) for t in (1, 2, 3, 4)])
        first = c.get("/batch", params={"lease_s": 30}).json()
        assert tags(first["batch"]) == [1, 2] and first["step"] == 0 and first["batch_id"]
        now[0] += 31  # the trainer died holding it
        again = c.get("/batch", params={"lease_s": 30}).json()
        assert tags(again["batch"]) == [1, 2] and again["step"] == 0 and again["batch_id"] != first["batch_id"]
        assert c.post("/ack", json={"batch_id": first["batch_id"]}).status_code == 404
        assert c.post("/ack", json={"batch_id": again["batch_id"]}).json() == {"status": "acknowledged"}
        now[0] += 100
        following = c.get("/batch", params={"lease_s": 30}).json()
        assert tags(following["batch"]) == [3, 4] and following["step"] == 1
        assert c.post("/ack", json={"batch_id": again["batch_id"]}).status_code == 404
        assert c.get("/status").json()["current_step"] == 2


def test_every_route_refuses_a_missing_or_wrong_key() -> None:
    app = create_app(ServerSettings(storage="memory", api_key="s3cret"))
    routes = {(m, r.path) for r in flat_routes(app.routes) for m in getattr(r, "methods", ()) if m != "HEAD"}
    guarded = {(m, p) for m, p in routes if p not in OPEN_PATHS | DOC_PATHS}
    assert {("POST", "/scored_data"), ("GET", "/batch"), ("GET", "/reset_data"), ("GET", "/dashboard/data")} <= guarded
    with TestClient(app) as c:
        for method, path in sorted(guarded):
            assert c.request(method, path).status_code == 401, path
            assert c.request(method, path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert all(c.get(path).status_code == 200 for path in OPEN_PATHS)
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/register", json=REG, headers=ok).status_code == 200
        assert c.get("/info", headers=ok).json()["batch_size"] == 8


def test_reset_can_be_switched_off() -> None:
    with client_for(allow_reset=False) as c:
        c.post("/register", json=REG)
        assert c.get("/reset_data").status_code == 403
        assert c.get("/info").json()["batch_size"] == 8


def test_msgpack_in_and_out_round_trips_exactly() -> None:
    groups = [group_from_json(group(t)) for t in (1, 2)]
    lp = groups[1].inference_logprobs
    groups[1].inference_logprobs = Ragged(np.full(lp.data.shape, -0.1, np.float32), lp.offsets)  # bit-exact float32
    with client_for() as c:
        c.post("/register", json=REG)
        headers = {"Content-Type": codec.MEDIA_TYPE}
        answer = c.post("/scored_data", content=codec.pack_group(groups[0]), headers=headers)
        assert answer.json() == {"status": "received"}
        body = codec.packb([codec.group_to_map(groups[1])])
        assert c.post("/scored_data_list", content=body, headers=headers).json()["groups_processed"] == 1
        raw = c.get("/batch", headers={"Accept": codec.MEDIA_TYPE})
        assert raw.headers["content-type"] == codec.MEDIA_TYPE
        served = msgpack.unpackb(raw.content)
        assert served["step"] == 0
        for sent, got in zip(groups, served["batch"], strict=True):
            back = codec.group_from_map(got)
            for name in ("tokens", "masks", "inference_logprobs"):
                np.testing.assert_array_equal(getattr(back, name).data, getattr(sent, name).data)
                assert getattr(back, name).data.dtype == getattr(sent, name).data.dtype
            np.testing.assert_array_equal(back.scores, sent.scores)


@pytest.mark.parametrize(
    "body",
    [b"\xc1garbage", codec.packb({"tokens": {"dtype": "<i4", "lengths": b"\x01\x00\x00\x00", "data": b"\x00"}})],
)
def test_malformed_msgpack_is_422_and_stores_nothing(body: bytes) -> None:
    with client_for() as c:
        c.post("/register", json=REG)
        answer = c.post("/scored_data", content=body, headers={"Content-Type": codec.MEDIA_TYPE})
        assert answer.status_code == 422
        assert c.get("/status").json()["queue_size"] == 0


def test_body_limit_and_bad_gzip() -> None:
    with client_for(max_body_bytes=2000) as c:
        c.post("/register", json=REG)
        big = group(1, n=60)
        assert c.post("/scored_data", json=big).status_code == 413
        assert c.post("/scored_data", content=b"not gzip", headers={"Content-Encoding": "gzip"}).status_code == 400
        assert c.get("/status").json()["queue_size"] == 0


def test_scored_data_before_register_does_not_wedge_the_server() -> None:
    with client_for() as c:
        assert c.post("/scored_data", json=group(1)).status_code == 200
        assert c.post("/register", json=REG).status_code == 200
        assert c.get("/info").json()["batch_size"] == 8
        c.post("/scored_data", json=group(2))
        assert tags(c.get("/batch").json()["batch"]) == [1, 2]
