"""``POST /policy-version`` over HTTP: the trainer's published version drives the staleness bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollhub.server import ServerSettings, create_app
from tests.server.test_extensions import REG as EXTENSIONS_REG

REG = {**EXTENSIONS_REG, "batch_size": 4}


def group(tag: int, version: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"tokens": [[tag, 1], [tag, 2]], "masks": [[1, 1], [1, 1]], "scores": [1.0, 0.0]}
    if version is not None:
        body["policy_version"] = version
    return body


def client_for(**settings: Any) -> TestClient:
    return TestClient(create_app(ServerSettings(**{"storage": "memory", **settings})))


def tags(answer: dict[str, Any]) -> list[int]:
    return [item["tokens"][0][0] for item in answer["batch"] or []]


def test_status_shows_the_published_version_null_before_the_first() -> None:
    with client_for() as c:
        assert c.get("/status").json()["policy_version"] is None
        answer = c.post("/policy-version", json={"policy_version": 2})
        assert answer.status_code == 200
        assert answer.json() == {"policy_version": 2, "stale_dropped": 0}
        assert c.get("/status").json()["policy_version"] == 2


def test_stale_items_are_dropped_counted_and_never_served() -> None:
    with client_for(max_staleness=1) as c:
        c.post("/register", json=REG)
        for tag, version in ((1, 0), (2, 1), (3, 2), (4, 3), (5, None), (6, 3)):
            assert c.post("/scored_data", json=group(tag, version)).status_code == 200
        answer = c.post("/policy-version", json={"policy_version": 3}).json()
        assert answer == {"policy_version": 3, "stale_dropped": 2}  # versions 0 and 1 are older than 3 - 1
        served = [tags(c.get("/batch").json()), tags(c.get("/batch").json())]
        assert served == [[3, 4], [5, 6]]
        assert c.get("/batch").json() == {"batch": None}
        status = c.get("/status").json()
        assert status["stale_dropped"] == {"None": 2} and status["policy_version"] == 3


def test_a_lower_version_answers_409_naming_the_field() -> None:
    with client_for() as c:
        c.post("/policy-version", json={"policy_version": 5})
        answer = c.post("/policy-version", json={"policy_version": 4})
        assert answer.status_code == 409
        (entry,) = answer.json()["detail"]
        assert entry["loc"] == ["body", "policy_version"] and "5" in entry["msg"]
        assert c.get("/status").json()["policy_version"] == 5


@pytest.mark.parametrize(
    "body", [{"policy_version": -1}, {"policy_version": "3"}, {"policy_version": 1.5}, {"policy_version": None}, {}]
)
def test_a_bad_body_answers_422_naming_the_field(body: dict[str, Any]) -> None:
    with client_for() as c:
        answer = c.post("/policy-version", json=body)
        assert answer.status_code == 422
        assert any(entry["loc"] == ["body", "policy_version"] for entry in answer.json()["detail"])
        assert c.get("/status").json()["policy_version"] is None


def test_the_api_key_is_required_like_on_every_data_route() -> None:
    with client_for(api_key="secret") as c:
        assert c.post("/policy-version", json={"policy_version": 1}).status_code == 401
        ok = c.post("/policy-version", json={"policy_version": 1}, headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200


def test_the_published_version_survives_a_restart_on_sqlite(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'buf.db'}"
    with client_for(storage=storage, max_staleness=0) as c:
        c.post("/register", json=REG)
        c.post("/policy-version", json={"policy_version": 7})
    with client_for(storage=storage, max_staleness=0) as c:
        assert c.get("/status").json()["policy_version"] == 7
        assert c.post("/policy-version", json={"policy_version": 6}).status_code == 409
        c.post("/scored_data", json=group(1, 6))  # 6 < 7 - 0: stale under the restored version
        c.post("/scored_data", json=group(2, 7))
        c.post("/scored_data", json=group(3, 7))
        assert tags(c.get("/batch").json()) == [2, 3]


def test_the_route_is_in_the_openapi_schema() -> None:
    with client_for() as c:
        schema = c.get("/openapi.json").json()
        operation = schema["paths"]["/policy-version"]["post"]
        assert {"200", "409", "422"} <= set(operation["responses"])
        assert "policy_version" in schema["components"]["schemas"]["StatusAnswer"]["properties"]


def test_the_stamp_unversioned_setting_versions_groups_on_arrival_over_http() -> None:
    """``rollhub serve --stamp-unversioned``: an Atropos environment's group (no ``policy_version``) is served
    with the version the trainer had published when it arrived, and the staleness bound applies to it."""
    from rollhub.cli import _serve_parser, _settings

    settings = _settings(_serve_parser("rollhub serve").parse_args(["--stamp-unversioned", "--storage", "memory"]))
    assert settings.stamp_unversioned and not _settings(_serve_parser("x").parse_args([])).stamp_unversioned
    with client_for(max_staleness=1, stamp_unversioned=True) as c:
        c.post("/register", json=REG)
        c.post("/policy-version", json={"policy_version": 3})
        assert c.post("/scored_data", json=group(1)).status_code == 200
        c.post("/policy-version", json={"policy_version": 5})
        assert c.post("/scored_data_list", json=[group(2), group(3)]).status_code == 200
        c.post("/policy-version", json={"policy_version": 6})  # 3 is stale at 6, 5 is not
        batch = c.get("/batch").json()
        assert tags(batch) == [2, 3] and [item["policy_version"] for item in batch["batch"]] == [5, 5]
        assert c.get("/status").json()["stale_dropped"] == {"None": 1}
