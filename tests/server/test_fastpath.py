"""The binary ingest fast path: taken only when it can answer exactly like the general route, and then
storing the group as views of the request body read into its own mapping (no compaction copy)."""

from __future__ import annotations

import gzip
import mmap
import re
from typing import Any

import msgpack
import numpy as np
import orjson
from fastapi.testclient import TestClient

from rollhub.experience.group import memory_owner
from rollhub.server import ServerSettings, create_app
from rollhub.wire import codec
from rollhub.wire.group import group_from_json, group_to_item
from tests.server.test_extensions import REG, group

BIN = {"Content-Type": codec.MEDIA_TYPE}
NUMPY = orjson.OPT_SERIALIZE_NUMPY


def packed(tag: int, n: int = 4, **extra: Any) -> bytes:
    return codec.pack_group(group_from_json({**group(tag, n), **extra}))


def big(tag: int) -> bytes:
    """A group large enough to be stored as a mapping (over the 64 KiB compaction floor)."""
    rows = 8
    tokens = np.arange(rows * 1024, dtype=np.int32).reshape(rows, 1024) + tag
    return codec.pack_group(
        group_from_json(
            {
                "tokens": tokens.tolist(),
                "masks": tokens.tolist(),
                "scores": [float(tag)] * rows,
                "inference_logprobs": np.full(tokens.shape, -0.5).tolist(),
            }
        )
    )


def app_client(**settings: Any) -> tuple[Any, TestClient]:
    app = create_app(ServerSettings(storage="memory", **settings))
    return app, TestClient(app)


def test_binary_post_takes_the_fast_path_and_is_stored_without_a_copy() -> None:
    app, client = app_client()
    with client as c:
        c.post("/register", json=REG)
        body = big(3)
        assert c.post("/scored_data", content=body, headers=BIN).json() == {"status": "received"}
        assert app.fast_ingest.taken == 1
        stored = app.state.buffer.latest_example()
        owner = memory_owner(stored.tokens.data)
        assert isinstance(owner, mmap.mmap) and len(owner) == len(body), "the body's own mapping is the storage"
        assert all(memory_owner(getattr(stored, f).data) is owner for f in ("masks", "inference_logprobs"))
        assert stored.tokens.data[:3].tolist() == [3, 4, 5]


def test_fast_and_general_paths_store_the_same_groups() -> None:
    bodies = [packed(1), packed(2, n=2, policy_version=0, env_id=None), big(5)]
    answers = []
    for binary in (True, False):
        app, client = app_client()
        with client as c:
            c.post("/register", json={**REG, "batch_size": 14})
            for body in bodies:
                if binary:
                    r = c.post("/scored_data", content=body, headers=BIN)
                else:  # the same groups as JSON: the general route
                    r = c.post(
                        "/scored_data", content=orjson.dumps(group_to_item(codec.unpack_group(body)), option=NUMPY)
                    )
                assert r.status_code == 200, r.text
            assert app.fast_ingest.taken == (3 if binary else 0)
            answers.append((c.get("/batch").json(), c.get("/status").json()))
    assert answers[0] == answers[1]


def test_list_bodies_are_taken_and_their_groups_compacted_apart() -> None:
    app, client = app_client()
    with client as c:
        c.post("/register", json=REG)
        body = codec.packb([msgpack.unpackb(big(1)), msgpack.unpackb(big(2))])
        answer = c.post("/scored_data_list", content=body, headers=BIN).json()
        assert answer == {"status": "received", "groups_processed": 2}
        assert app.fast_ingest.taken == 1
        items = list(app.state.buffer.storage._items.values())
        owners = [memory_owner(payload.tokens.data) for payload, _ in items]
        # one shared body would pin both groups' memory until both are served: each gets its own mapping
        assert len({id(o) for o in owners}) == 2 and all(len(o) < len(body) for o in owners)
        assert [int(payload.scores[0]) for payload, _ in items] == [1, 2]


def test_what_the_fast_path_leaves_to_the_general_route() -> None:
    app, client = app_client(api_key="k")
    auth = {**BIN, "Authorization": "Bearer k"}
    with client as c:
        c.post("/register", json=REG, headers=auth)
        body = packed(1)
        assert c.post("/scored_data", content=body, headers={**BIN, "Authorization": "Bearer no"}).status_code == 401
        assert c.post(
            "/scored_data", content=gzip.compress(body), headers={**auth, "Content-Encoding": "gzip"}
        ).is_success
        cors = c.post("/scored_data", content=body, headers={**auth, "Origin": "http://ui.example"})
        assert cors.is_success and cors.headers["access-control-allow-origin"] == "http://ui.example"
        assert app.fast_ingest.taken == 0
        assert c.post("/scored_data", content=body, headers=auth).is_success
        assert app.fast_ingest.taken == 1
        assert c.get("/status", headers=auth).json()["queue_size"] == 3  # groups


def test_bad_bodies_get_the_same_answer_on_both_paths() -> None:
    answers = []
    for binary in (True, False):
        app, client = app_client()
        with client as c:
            c.post("/register", json=REG)
            headers = BIN if binary else {**BIN, "Content-Encoding": "identity", "Origin": "x"}
            bad = c.post("/scored_data", content=b"\xc1garbage", headers=headers)
            one_score = c.post("/scored_data", content=codec.packb({**group(1), "scores": [1.0]}), headers=headers)
            not_list = c.post("/scored_data_list", content=codec.packb(group(1)), headers=headers)
            assert app.fast_ingest.taken == (3 if binary else 0)
            answers.append([(r.status_code, r.json()) for r in (bad, one_score, not_list)])
    assert answers[0] == answers[1]
    (bad, _), (one_score, detail), (not_list, _) = answers[0]
    assert (bad, one_score, not_list) == (422, 422, 422)
    assert detail["detail"][0]["loc"] == ["body", "scores"] and "scores has 1 values but tokens has 4" in str(detail)


def test_validation_errors_are_worded_by_the_general_route() -> None:
    for binary in (True, False):
        _app, client = app_client()
        with client as c:
            c.post("/register", json=REG)
            bad = {**group(1), "scores": [1.0]}  # one score for four sequences
            if binary:
                r = c.post("/scored_data", content=codec.packb(bad), headers=BIN)
            else:
                r = c.post("/scored_data", json=bad)
            assert r.status_code == 422 and "scores has 1 values but tokens has 4" in r.text
            assert c.get("/status").json()["queue_size"] == 0


def test_queue_full_is_answered_on_the_fast_path_with_retry_after() -> None:
    app, client = app_client(max_queued_sequences=4, retry_after_s=2.0)
    with client as c:
        c.post("/register", json=REG)
        assert c.post("/scored_data", content=packed(1), headers=BIN).is_success
        refused = c.post("/scored_data", content=packed(2), headers=BIN)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
        assert "max_queued_sequences" in refused.text or "queue" in refused.text
        assert app.fast_ingest.taken == 2
        assert c.get("/status").json()["queue_size"] == 1  # the refused group stored nothing


def test_request_latency_histograms_cover_both_paths() -> None:
    _app, client = app_client()
    with client as c:
        c.post("/register", json=REG)
        c.post("/scored_data", content=packed(1), headers=BIN)
        c.post("/scored_data", json=group(2))
        c.get("/nope")
        text = c.get("/metrics").text
    count = re.search(r'rollhub_request_seconds_count\{method="POST",route="/scored_data"\} (\d+)', text)
    assert count and int(count.group(1)) == 2
    assert 'rollhub_requests_total{method="POST",route="/register",status="200"} 1' in text
    assert 'rollhub_requests_total{method="GET",route="other",status="404"} 1' in text


def test_sqlite_stores_an_exact_body_as_sent_and_re_encodes_the_rest(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path}/f.db"
    exact = big(1)
    as_map = msgpack.unpackb(big(2))
    as_map["note"] = "an unknown key"  # would be stored (and served raw) if the body were kept
    widened = msgpack.unpackb(big(3))
    widened["tokens"]["data"] = np.frombuffer(widened["tokens"]["data"], "<i4").astype("<i8").tobytes()
    widened["tokens"]["dtype"] = "<i8"  # narrowed to int32 on the way in: the body no longer matches
    bodies = [exact, codec.packb(as_map), codec.packb(widened)]
    app = create_app(ServerSettings(storage=url))
    with TestClient(app) as c:
        c.post("/register", json={**REG, "batch_size": 24})
        for body in bodies:
            assert c.post("/scored_data", content=body, headers=BIN).is_success
        buffer = app.state.buffer
        stored = buffer.storage.raw_payloads([e.gid for e in buffer.queued()])
        assert stored[0] == exact
        assert stored[1] != bodies[1] and stored[2] != bodies[2]
        assert app.fast_ingest.taken == 3
    with TestClient(create_app(ServerSettings(storage=url))) as c:  # restart: read back from the file
        served = c.get("/batch").json()["batch"]
    assert [item["scores"][0] for item in served] == [1.0, 2.0, 3.0]
    assert served[2]["tokens"][0][:2] == [3, 4] and "note" not in served[1]
    for item, body in zip(served, [big(1), big(2), big(3)], strict=True):
        assert item == orjson.loads(orjson.dumps(group_to_item(codec.unpack_group(body)), option=NUMPY))


def test_bodies_past_the_prefault_size_are_read_the_same(monkeypatch: Any) -> None:
    from rollhub.server import fastpath

    monkeypatch.setattr(fastpath, "PREFAULT_MAX", 1024)  # big(...) bodies are ~200 KB: faulted as they arrive
    app, client = app_client()
    with client as c:
        c.post("/register", json=REG)
        assert c.post("/scored_data", content=big(4), headers=BIN).is_success
        assert app.fast_ingest.taken == 1
        assert app.state.buffer.latest_example().tokens.data[:2].tolist() == [4, 5]


def test_small_bodies_are_read_into_the_heap_not_a_mapping_each() -> None:
    app, client = app_client()
    with client as c:
        c.post("/register", json=REG)
        assert c.post("/scored_data", content=packed(6), headers=BIN).is_success
        stored = app.state.buffer.latest_example()
        assert isinstance(memory_owner(stored.tokens.data), bytearray)
        assert stored.tokens.data[:1].tolist() == [6] and app.fast_ingest.taken == 1
