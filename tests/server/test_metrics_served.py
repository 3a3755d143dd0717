"""/metrics and /dashboard/data count exactly what was served: staleness and age histograms, per-env flows."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from rollhub.buffer import BufferConfig, ExperienceBuffer, MemoryStorage
from rollhub.server import ServerSettings, create_app
from rollhub.server.dashboard import DATA_PATH
from tests.conftest import registration_body

REG = registration_body(8, starting_step=40)
AGE_LE = [0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800, 3600]


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def group(tag: int, env_id: int | None, version: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "tokens": [[tag, i, 9] for i in range(4)],
        "masks": [[-100, i, 9] for i in range(4)],
        "scores": [1.0] * 4,
    }
    if env_id is not None:
        body["env_id"] = env_id
    if version is not None:
        body["policy_version"] = version
    return body


def env(name: str) -> dict[str, Any]:
    return {"max_token_length": 64, "desired_name": name, "weight": 1.0, "group_size": 4}


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text page, keyed by name and label set (the parser rejects malformed text)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def value(figures: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return figures[(name, frozenset(labels.items()))]


def buckets(figures: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, bounds: list[str]) -> list[int]:
    """Per-bucket (non-cumulative) counts from the cumulative ``_bucket`` series, ``+Inf`` last."""
    cumulative = [value(figures, f"{name}_bucket", le=le) for le in [*bounds, "+Inf"]]
    return [int(b - a) for a, b in zip([0.0, *cumulative], cumulative, strict=False)]


def serve(c: TestClient, clock: Clock, at: float, **params: Any) -> dict[str, Any]:
    clock.now = at
    answer = c.get("/batch", params=params).json()
    assert answer["batch"] is not None and len(answer["batch"]) == 2
    return answer


def post(c: TestClient, clock: Clock, at: float, *groups: dict[str, Any]) -> None:
    clock.now = at
    assert c.post("/scored_data_list", json=list(groups)).status_code == 200


@pytest.fixture
def traffic() -> Any:
    """Three envs (two named alpha), six served batches (one a redelivered lease) and one failed serve."""
    clock = Clock()
    buf = ExperienceBuffer(MemoryStorage(), BufferConfig(), clock=clock)
    with TestClient(create_app(ServerSettings(storage="memory"), buffer=buf)) as c:
        c.post("/register", json=REG)
        assert c.get("/batch").json() == {"batch": None}  # the trainer has started: envs may register
        assert [c.post("/register-env", json=env(n)).json()["env_id"] for n in ("alpha", "beta", "alpha")] == [0, 1, 2]
        post(c, clock, 100, group(1, 0, 40), group(2, 1, 39))
        serve(c, clock, 100.5)  # step 40: lags 0, 1; waited 0.5 s
        assert c.get("/status").json()["current_step"] == 41
        post(c, clock, 200, group(3, 2, 36), group(4, None, None))
        serve(c, clock, 203)  # step 41: lag 5 and an item without a version; waited 3 s
        post(c, clock, 300, group(5, 0, 34), group(6, 1, 0))
        serve(c, clock, 4300)  # step 42: lags 8, 42; waited 4000 s
        post(c, clock, 5000, group(7, 1, 33), group(8, 0, 41))
        serve(c, clock, 5000)  # step 43: lags 10, 2; waited 0 s
        post(c, clock, 6000, group(9, 2, 44), group(10, 1, 43))
        first = serve(c, clock, 6000, lease_s=10)  # step 44: lags 0, 1; waited 0 s
        again = serve(c, clock, 6020, lease_s=10)  # expired, served again while the step is 45: lags 1, 2
        assert again["step"] == first["step"] == 44 and again["batch_id"] != first["batch_id"]
        assert c.post("/ack", json={"batch_id": again["batch_id"]}).status_code == 200
        post(c, clock, 7000, group(11, 0, 45), group(12, 1, 45))

        def broken(batch: Any) -> Any:
            raise RuntimeError("encoding failed")

        with pytest.raises(RuntimeError):
            buf.serve_batch(broken)  # formed, not committed: counted as a failure, not as served
        yield c


def test_metrics_count_served_items_by_version_lag_age_and_env(traffic: TestClient) -> None:
    figures = samples(traffic.get("/metrics").text)
    staleness = buckets(figures, "rollhub_served_staleness_versions", ["0", "1", "2", "3", "4", "6", "8", "16", "32"])
    assert staleness == [2, 3, 2, 0, 0, 1, 1, 1, 0, 1]
    assert value(figures, "rollhub_served_staleness_versions_count") == 11  # 12 served items, one without a version
    assert value(figures, "rollhub_served_staleness_versions_sum") == 72
    age = buckets(figures, "rollhub_served_item_age_seconds", [f"{b:g}" for b in AGE_LE])
    assert age == [4, 0, 0, 2, 0, 2, 0, 0, 0, 0, 0, 0, 0, 2]  # the redelivery is not counted again
    assert value(figures, "rollhub_served_item_age_seconds_count") == 10
    expected = {
        "rollhub_ingested_groups_total": {"alpha": 6, "beta": 5, "(no env)": 1},
        "rollhub_ingested_sequences_total": {"alpha": 24, "beta": 20, "(no env)": 4},
        "rollhub_served_groups_total": {"alpha": 6, "beta": 5, "(no env)": 1},
        "rollhub_served_sequences_total": {"alpha": 24, "beta": 20, "(no env)": 4},
    }
    for name, per_env in expected.items():
        assert {e: value(figures, name, env=e) for e in per_env} == per_env, name
        assert sum(v for (n, _), v in figures.items() if n == name) == sum(per_env.values()), name
    queue = {("0", "alpha"): (1, 4), ("1", "beta"): (1, 4), ("2", "alpha"): (0, 0)}
    for (env_id, name), (groups, sequences) in queue.items():
        assert value(figures, "rollhub_queue_groups_by_env", env_id=env_id, env=name) == groups
        assert value(figures, "rollhub_queue_sequences_by_env", env_id=env_id, env=name) == sequences
    assert value(figures, "rollhub_lease_expiries_total") == 1
    assert value(figures, "rollhub_serve_failures_total") == 1
    assert value(figures, "rollhub_sequences_out_total") == 48
    assert value(figures, "rollhub_redelivered_total") == 1


def test_dashboard_data_carries_the_same_figures(traffic: TestClient) -> None:
    data = traffic.get(DATA_PATH).json()
    assert data["served"] == {"groups": 12, "sequences": 48, "by_env": {"alpha": 24, "beta": 20, "(no env)": 4}}
    assert data["ingested"] == {"groups": 12, "sequences": 48, "by_env": {"alpha": 24, "beta": 20, "(no env)": 4}}
    assert (data["refused_429"], data["stale_dropped_total"]) == (0, 0)
    assert (data["lease_expiries"], data["serve_failures"]) == (1, 1)
    assert data["staleness"] == {"le": [0, 1, 2, 3, 4, 6, 8, 16, 32], "counts": [2, 3, 2, 0, 0, 1, 1, 1, 0, 1]}
    assert data["age_s"] == {"le": AGE_LE, "counts": [4, 0, 0, 2, 0, 2, 0, 0, 0, 0, 0, 0, 0, 2]}
    rows = {(row["env_id"], row["name"]): row for row in data["envs"]}
    served = {key: row["served_sequences"] for key, row in rows.items()}
    assert served == {(0, "alpha"): 12, (1, "beta"): 20, (2, "alpha"): 12, (None, "(no env)"): 4}
    assert all(row["min_batch_allocation"] is None for row in rows.values())


def test_dashboard_rows_carry_min_batch_allocation() -> None:
    with TestClient(create_app(ServerSettings(storage="memory"))) as c:
        c.post("/register", json=REG)
        c.get("/batch")
        c.post("/register-env", json={**env("alpha"), "min_batch_allocation": 0.25})
        c.post("/register-env", json=env("beta"))
        rows = c.get(DATA_PATH).json()["envs"]
        assert [(r["name"], r["min_batch_allocation"], r["served_sequences"]) for r in rows] == [
            ("alpha", 0.25, 0),
            ("beta", None, 0),
        ]
