"""What a 200 means: every accepted group is served, and a failure while answering loses nothing.

Poison that no answer can carry is refused at ingest on every route (JSON general and fast path, msgpack fast
path and general route) with a 422 naming the field and the path; the queue is untouched. A batch whose answer
fails to encode anyway (injected here by storing a group past admission) is put back whole and first in line, with
and without leases, on both storage backends (the replay buffer: test_replay_guarantee.py).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import httpx
import msgpack
import orjson
import pytest
from fastapi.testclient import TestClient

from rollhub.buffer import ExperienceBuffer, make_storage
from rollhub.server import ServerSettings, create_app, shapes
from rollhub.server.storage import GROUP_CODEC
from rollhub.wire import codec
from rollhub.wire.group import group_from_json
from rollhub.wire.models import Registration
from tests.conftest import ServerProcess
from tests.server.test_extensions import REG, group

BIN = {"Content-Type": codec.MEDIA_TYPE}
JSON = {"Content-Type": "application/json"}
ACCEPT_BIN = {"Accept": codec.MEDIA_TYPE}


class FakeClock:
    """A clock that moves only when told to (lease deadlines)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def app_for(storage: str = "memory", clock: FakeClock | None = None) -> tuple[Any, TestClient]:
    buf = ExperienceBuffer(make_storage(storage, GROUP_CODEC), clock=clock or FakeClock())
    app = create_app(ServerSettings(storage=storage), buffer=buf)
    return app, TestClient(app, raise_server_exceptions=False)


@pytest.fixture(params=["memory", "sqlite"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "memory" if request.param == "memory" else f"sqlite:///{tmp_path}/buf.db"


# (id, field, value, the path the 422 names, whether JSON can send it at all)
POISON = [
    ("bin", "images", [b"\x89PNG"], "images[0]", False),
    ("ext", "generation_params", {"x": msgpack.ExtType(3, b"ab")}, 'generation_params["x"]', False),
    (
        "timestamp",
        "group_overrides",
        {"at": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)},
        'group_overrides["at"]',
        False,
    ),
    ("int-key", "overrides", [{"a": [0, 1, 2, {1: "x"}]}] * 4, 'overrides[0]["a"][3]', False),
    ("nil-key", "group_overrides", {None: 1}, "group_overrides", False),
    ("deep", "images", nested(300), "images" + "[0]" * 32, True),
    ("nan", "distill_logprobs", [[[float("nan")]]] * 4, "distill_logprobs[0][0][0]", False),
    ("inf", "images", {"v": float("inf")}, 'images["v"]', False),
]


def poisoned(field: str, value: Any) -> dict[str, Any]:
    return {**group(7), field: value}


def msgpack_body(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, datetime=True)


@pytest.mark.parametrize(("field", "value", "path", "as_json"), [p[1:] for p in POISON], ids=[p[0] for p in POISON])
def test_poison_is_refused_on_every_ingest_route_and_the_queue_is_untouched(
    field: str, value: Any, path: str, as_json: bool
) -> None:
    app, client = app_for()
    with client as c:
        c.post("/register", json={**REG, "batch_size": 4})
        assert c.post("/scored_data", json=group(1)).status_code == 200
        before = c.get("/status").json()
        bodies = [
            ("/scored_data", msgpack_body(poisoned(field, value)), BIN),
            ("/scored_data_list", msgpack_body([group(2), poisoned(field, value)]), BIN),
        ]
        if as_json:
            bodies += [
                ("/scored_data", json.dumps(poisoned(field, value)).encode(), JSON),
                ("/scored_data_list", json.dumps([group(2), poisoned(field, value)]).encode(), JSON),
            ]
        for route, body, headers in bodies:
            answer = c.post(route, content=body, headers=headers)
            assert answer.status_code == 422, (route, answer.text)
            (detail,) = answer.json()["detail"]
            where = ["body", 1, field] if route == "/scored_data_list" else ["body", field]
            assert detail["loc"][: len(where)] == where, detail
            assert detail["msg"].startswith(f"{path}: "), detail["msg"]
        assert app.fast_ingest.taken == 2, "the fast path answers refused binary bodies itself, worded the same"
        assert c.get("/status").json() == before
        assert c.get("/batch").json()["batch"][0]["tokens"][0][0] == 1  # the good group is still served


def test_accepted_free_fields_come_back_through_every_serve_path() -> None:
    extras = {
        "images": {"big": 2**64 - 1, "neg": -(2**63), "f": -0.0, "s": "é", "l": nested(30)},
        "generation_params": {"temperature": 0.7, "stop": ["\n"]},
        "overrides": [{"k": i} for i in range(4)],
        "distill_token_ids": [[[1, 2]]] * 4,
        "distill_logprobs": [[[-0.5, -1.5]]] * 4,
    }
    clock = FakeClock()
    _, client = app_for(clock=clock)
    with client as c:
        c.post("/register", json={**REG, "batch_size": 4})
        for body, headers in [
            (orjson.dumps({**group(1), **extras}), JSON),
            (msgpack_body({**group(1), **extras}), BIN),
        ]:
            assert c.post("/scored_data", content=body, headers=headers).status_code == 200
            assert {k: c.get("/latest_example").json()[k] for k in extras} == extras
            leased = c.get("/batch", params={"lease_s": 5}).json()["batch"][0]
            clock.now += 10  # the lease expires: the same batch is served again, here as msgpack
            again = msgpack.unpackb(c.get("/batch", headers=ACCEPT_BIN).content)["batch"][0]
            assert {k: leased[k] for k in extras} == {k: again[k] for k in extras} == extras


def inject(app: Any, tag: int) -> None:
    """Store a group past admission whose JSON answer cannot be encoded (a bin value in ``images``)."""
    bad = group_from_json(group(tag))
    bad.meta["images"] = [b"\x00raw"]
    app.state.buffer.ingest([bad])


def tags_of(answer: Any, binary: bool) -> list[int]:
    payload = msgpack.unpackb(answer.content) if binary else answer.json()
    batch = payload["batch"]
    if binary:
        return [int(codec.map_to_arrays(g)["tokens"][0][0]) for g in batch]
    return [g["tokens"][0][0] for g in batch]


def test_a_failed_answer_puts_the_whole_batch_back_first_in_line(storage: str) -> None:
    app, client = app_for(storage)
    with client as c:
        c.post("/register", json=REG)  # batch_size 8: two groups of 4
        assert c.post("/scored_data", json=group(1)).status_code == 200
        inject(app, 2)
        for _ in range(2):
            assert c.get("/batch").status_code == 500
        status = c.get("/status").json()
        assert (status["queue_size"], status["current_step"], status["serve_failures"]) == (2, 0, 2)
        c.post("/scored_data_list", json=[group(3), group(4)])  # arrives later: must not jump ahead
        answer = c.get("/batch", headers=ACCEPT_BIN)
        assert answer.status_code == 200 and tags_of(answer, True) == [1, 2]
        assert msgpack.unpackb(answer.content)["step"] == 0
        assert tags_of(c.get("/batch"), False) == [3, 4]
        assert c.get("/status").json()["current_step"] == 2


def test_a_failed_leased_answer_leases_nothing_and_a_failed_redelivery_stays_first(storage: str) -> None:
    clock = FakeClock()
    app, client = app_for(storage, clock)
    with client as c:
        c.post("/register", json=REG)
        c.post("/scored_data", json=group(1))
        inject(app, 2)
        assert c.get("/batch", params={"lease_s": 30}).status_code == 500
        status = c.get("/status").json()
        assert (status["queue_size"], status["leased_batches"], status["serve_failures"]) == (2, 0, 1)
        leased = c.get("/batch", params={"lease_s": 30}, headers=ACCEPT_BIN)
        assert tags_of(leased, True) == [1, 2]
        clock.now += 60  # not acknowledged: due again, and its JSON redelivery fails every time
        c.post("/scored_data_list", json=[group(3), group(4)])
        for _ in range(3):
            assert c.get("/batch", params={"lease_s": 30}).status_code == 500
        status = c.get("/status").json()
        assert (status["queue_size"], status["current_step"], status["serve_failures"]) == (2, 1, 4)
        again = c.get("/batch", params={"lease_s": 30}, headers=ACCEPT_BIN)
        payload = msgpack.unpackb(again.content)
        assert tags_of(again, True) == [1, 2] and payload["step"] == 0
        assert c.post("/ack", json={"batch_id": payload["batch_id"]}).status_code == 200
        assert tags_of(c.get("/batch"), False) == [3, 4]


def test_the_core_commits_only_after_the_encoder_returned(storage: str) -> None:
    buf = ExperienceBuffer(make_storage(storage, GROUP_CODEC))
    buf.register_trainer(shapes.trainer_run(Registration(**REG)))
    buf.ingest([group_from_json(group(t)) for t in (1, 2, 3, 4)])

    def broken(batch: Any) -> Any:
        raise RuntimeError("encoder failed")

    for lease_s in (None, 5.0):
        with pytest.raises(RuntimeError):
            buf.serve_batch(broken, lease_s)
    assert [e.gid for e in buf.queued()] == [1, 2, 3, 4]
    assert buf.status().serve_failures == 2 and buf.step == 0
    reopened = ExperienceBuffer(buf.storage)  # what is stored agrees: nothing was taken
    assert [e.gid for e in reopened.queued()] == [1, 2, 3, 4]
    served = buf.serve_batch(lambda b: [int(g.tokens.data[0]) for g in b.items])
    assert served == [1, 2] and [e.gid for e in buf.queued()] == [3, 4]


def test_rollhub_serve_refuses_poison_and_serves_every_accepted_group(
    server_factory: type[ServerProcess], sqlite_url: str
) -> None:
    """The issue's report end to end, against a real ``rollhub serve`` (uvicorn, fast path, SQLite)."""
    server = server_factory("--storage", sqlite_url).start(timeout_s=120)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.post("/register", json=REG)
        poison = [
            (msgpack_body(poisoned("images", [b"\x89PNG"])), BIN),
            (
                msgpack_body(poisoned("group_overrides", {"at": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)})),
                BIN,
            ),
            (msgpack_body(poisoned("overrides", [{1: "x"}] * 4)), BIN),
            (json.dumps(poisoned("images", nested(300))).encode(), JSON),
        ]
        assert c.post("/scored_data", json=group(1)).status_code == 200
        for body, headers in poison:
            answer = c.post("/scored_data", content=body, headers=headers)
            assert answer.status_code == 422 and answer.json()["detail"][0]["msg"], answer.text
        assert c.post("/scored_data", content=codec.pack_group(group_from_json(group(2))), headers=BIN).is_success
        assert c.get("/latest_example").json()["tokens"][0][0] == 2
        leased = c.get("/batch", params={"lease_s": 60}).json()
        assert [g["tokens"][0][0] for g in leased["batch"]] == [1, 2]
        assert c.post("/ack", json={"batch_id": leased["batch_id"]}).status_code == 200
        status = c.get("/status").json()
        assert (status["queue_size"], status["leased_batches"], status["serve_failures"]) == (0, 0, 0)
