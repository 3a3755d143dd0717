"""``POST /fleet``: a rollout fleet's report reaches ``/metrics`` and ``/dashboard/data`` exactly; a bad body is
answered 422 naming the field and changes nothing; the API key is required; the server holds a bounded number."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rollhub.observe.fleet_report import FleetReport
from rollhub.server import ServerSettings, create_app
from rollhub.server.dashboard import DATA_PATH
from rollhub.server.fleets import FleetReports
from tests.server.test_metrics_served import samples, value

KEY = "k-fleet"
AUTH = {"Authorization": f"Bearer {KEY}"}


def figures(worker: str, steps: int, *, restarts: int = 0, version: int | None = 2, **extra: Any) -> dict[str, Any]:
    """One worker slot of a report: ``steps`` environment steps in batches of 4."""
    return {
        "worker": worker,
        "id": worker if not restarts else f"{worker}r{restarts}",
        "state": "running",
        "weight_version": version,
        "env_steps": steps,
        "turns": steps // 4,
        "forward_passes": steps // 4,
        "inference_observations": steps,
        "items_sent": steps // 64,
        "dropped_steps": 3,
        "pace_waits": 5,
        "env_restarts": 1,
        "restarts": restarts,
        "phase_seconds": {"recv_obs": 0.5, "inference": 1.25, "send_actions": 0.125},
        **extra,
    }


def report(fleet: str = "cartpole", time: float = 1000.0, *workers: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"fleet": fleet, "time": time, "workers": list(workers) or [figures("w0", 640)], **extra}


@pytest.fixture
def client() -> Any:
    with TestClient(create_app(ServerSettings(storage="memory", api_key=KEY)), headers=AUTH) as c:
        yield c


def fleet_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "rollhub_fleet_" in line]


def test_a_posted_report_is_in_metrics_with_exact_values(client: TestClient) -> None:
    assert fleet_lines(client.get("/metrics").text) == []  # nothing before a fleet reported
    body = report("cartpole", 1000.0, figures("w0", 640), figures("w1", 320, restarts=2, version=None))
    answer = client.post("/fleet", json={**body, "status_errors": 1, "post_errors": 4})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"status": "received", "fleet": "cartpole", "workers": 2}
    text = client.get("/metrics").text
    got = samples(text)  # well-formed, no duplicate series
    assert value(got, "rollhub_fleet_env_steps_total", fleet="cartpole", worker="w0") == 640
    assert value(got, "rollhub_fleet_env_steps_total", fleet="cartpole", worker="w1") == 320
    assert value(got, "rollhub_fleet_forward_passes_total", fleet="cartpole", worker="w1") == 80
    assert value(got, "rollhub_fleet_inference_observations_total", fleet="cartpole", worker="w1") == 320
    assert value(got, "rollhub_fleet_phase_seconds_total", fleet="cartpole", worker="w0", phase="inference") == 1.25
    assert value(got, "rollhub_fleet_worker_weight_version", fleet="cartpole", worker="w0") == 2
    assert ("rollhub_fleet_worker_weight_version", frozenset({("fleet", "cartpole"), ("worker", "w1")})) not in got
    assert value(got, "rollhub_fleet_worker_restarts_total", fleet="cartpole", worker="w1") == 2
    assert value(got, "rollhub_fleet_env_restarts_total", fleet="cartpole", worker="w0") == 1
    assert value(got, "rollhub_fleet_worker_info", fleet="cartpole", worker="w1", id="w1r2", state="running") == 1
    assert value(got, "rollhub_fleet_workers", fleet="cartpole", state="running") == 2
    assert value(got, "rollhub_fleet_reporter_errors_total", fleet="cartpole", kind="post") == 4
    assert value(got, "rollhub_fleet_report_age_seconds", fleet="cartpole") >= 0
    assert 'rollhub_fleet_env_steps_total{fleet="cartpole",worker="w0"} 640' in text.splitlines()
    assert "# TYPE rollhub_fleet_phase_seconds_total counter" in text


def test_a_newer_report_replaces_the_fleets_last_and_fleets_are_kept_apart(client: TestClient) -> None:
    assert client.post("/fleet", json=report("a", 1.0, figures("w0", 100))).status_code == 200
    assert client.post("/fleet", json=report("b", 1.0, figures("w0", 7))).status_code == 200
    assert client.post("/fleet", json=report("a", 3.0, figures("w0", 300))).status_code == 200
    got = samples(client.get("/metrics").text)
    assert value(got, "rollhub_fleet_env_steps_total", fleet="a", worker="w0") == 300
    assert value(got, "rollhub_fleet_env_steps_total", fleet="b", worker="w0") == 7
    fleets = client.get(DATA_PATH).json()["fleets"]
    assert [(f["fleet"], f["time"], f["workers"][0]["env_steps"]) for f in fleets] == [("a", 3.0, 300), ("b", 1.0, 7)]


WORDS = {"inference": "fast"}
BAD: list[tuple[dict[str, Any], list[Any]]] = [
    (report("f", 1.0, figures("w0", 5, env_steps=-5)), ["body", "workers", 0, "env_steps"]),
    (report("f", 1.0, figures("w0", 5, env_steps="5")), ["body", "workers", 0, "env_steps"]),
    (report("f", 1.0, figures("w0", 5, weight_version=False)), ["body", "workers", 0, "weight_version"]),
    (report("f", 1.0, figures("w0", 5, phase_seconds=WORDS)), ["body", "workers", 0, "phase_seconds", "inference"]),
    (report("f", 1.0, figures("w0", 5), figures("w0", 6)), ["body", "workers"]),
    (report("f", 1.0, figures("w0", 5, shoe_size=44)), ["body", "workers", 0, "shoe_size"]),
    (report("", 1.0), ["body", "fleet"]),
    (report("f", -1.0), ["body", "time"]),
    ({"fleet": "f", "time": 1.0}, ["body", "workers"]),
]


@pytest.mark.parametrize(("body", "loc"), BAD)
def test_a_bad_report_is_refused_naming_the_field_and_nothing_is_kept(
    client: TestClient, body: dict[str, Any], loc: list[Any]
) -> None:
    assert client.post("/fleet", json=report("kept", 1.0, figures("w0", 40))).status_code == 200
    before = fleet_lines(client.get("/metrics").text)
    bad = copy.deepcopy(body)
    bad["fleet"] = bad["fleet"] and "kept"  # the same fleet: a refused report must not replace its last one
    answer = client.post("/fleet", json=bad)
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert [e["loc"] for e in detail] == [loc], detail
    assert all(e["msg"] for e in detail)
    after = [line for line in fleet_lines(client.get("/metrics").text) if "report_age_seconds{" not in line]
    assert after == [line for line in before if "report_age_seconds{" not in line]
    assert [f["workers"][0]["env_steps"] for f in client.get(DATA_PATH).json()["fleets"]] == [40]


def test_a_body_that_is_not_json_is_refused_and_nothing_is_kept(client: TestClient) -> None:
    answer = client.post("/fleet", content=b"{not json", headers={"Content-Type": "application/json"})
    assert answer.status_code == 422
    assert client.get(DATA_PATH).json()["fleets"] == []


def test_the_fleet_route_needs_the_api_key(client: TestClient) -> None:
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        answer = client.post("/fleet", json=report(), headers=headers)
        assert answer.status_code == 401, answer.text
        assert "API key" in answer.json()["detail"]
    assert client.get(DATA_PATH).json()["fleets"] == []
    assert client.post("/fleet", json=report()).status_code == 200


def test_the_dashboard_data_carries_the_fleets(client: TestClient) -> None:
    assert client.get(DATA_PATH).json()["fleets"] == []
    client.post("/fleet", json=report("cartpole", 12.5, figures("w0", 640), figures("w1", 0, version=None)))
    (fleet,) = client.get(DATA_PATH).json()["fleets"]
    assert fleet["fleet"] == "cartpole" and fleet["time"] == 12.5 and fleet["age_s"] >= 0
    w0, w1 = fleet["workers"]
    assert (w0["worker"], w0["env_steps"], w0["weight_version"], w0["mean_batch"]) == ("w0", 640, 2, 4.0)
    assert (w1["weight_version"], w1["mean_batch"]) == (None, None)


def test_the_schema_documents_the_route_and_its_errors(client: TestClient) -> None:
    operation = client.get("/openapi.json").json()["paths"]["/fleet"]["post"]
    assert {"200", "401", "422"} <= set(operation["responses"])
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/FleetReport")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_server_holds_a_bounded_number_of_fleets_forgetting_the_least_recent() -> None:
    clock = Clock()
    held = FleetReports(max_fleets=2, clock=clock)
    for name in ("a", "b"):
        held.put(FleetReport.model_validate(report(name)))
        clock.now += 1
    held.put(FleetReport.model_validate(report("a", 2.0)))  # "a" reported again: now "b" is the least recent
    clock.now += 1
    held.put(FleetReport.model_validate(report("c")))
    assert [(r.report.fleet, r.age_s) for r in held.received()] == [("a", 1.0), ("c", 0.0)]
