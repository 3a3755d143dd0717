"""/metrics is well-formed Prometheus text, and the Grafana board queries only metrics and labels it emits (in
its expressions, label matchers and legends) and charts the buffer, the fleet and a group run's own figures."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from rollhub.buffer import BufferConfig, ExperienceBuffer, MemoryStorage
from rollhub.server import ServerSettings, create_app
from tests.observe.test_run_figures import figures as run_figures
from tests.observe.test_run_figures import report as run_report
from tests.server.test_fleet_route import figures, report
from tests.server.test_metrics_served import REG, Clock, env, group

BOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "rollhub.json"
SUFFIXES = ("_bucket", "_sum", "_count")


@pytest.fixture
def page() -> str:
    """/metrics after traffic that touches every metric: leases, a stale drop, a 429, an item without an env, a
    step fleet's report, and a group run's report that carries the run's own figures (as its reporter posts it)."""
    clock = Clock()
    buf = ExperienceBuffer(MemoryStorage(), BufferConfig(max_staleness=1, max_queued_sequences=16), clock=clock)
    with TestClient(create_app(ServerSettings(storage="memory"), buffer=buf)) as c:
        c.post("/register", json={**REG, "starting_step": 0})
        c.get("/batch")
        assert c.post("/register-env", json=env('gamma "quoted"')).json()["env_id"] == 0
        c.post("/scored_data_list", json=[group(1, 0, 0), group(2, None, 0)])
        leased = c.get("/batch", params={"lease_s": 5}).json()
        clock.now += 10
        again = c.get("/batch", params={"lease_s": 5}).json()
        assert again["batch_id"] != leased["batch_id"]
        c.post("/ack", json={"batch_id": again["batch_id"]})
        c.post("/scored_data_list", json=[group(3, 0, 1), group(4, 0, 1)])
        assert len(c.get("/batch").json()["batch"]) == 2  # step 1 -> 2
        c.post("/scored_data_list", json=[group(5, 0, 0), group(6, 0, 2), group(7, None, 2)])
        assert c.get("/batch").json()["batch"] is not None  # version 0 is dropped as stale at step 2
        c.post("/scored_data", json=group(8, 0, 3))
        assert c.post("/scored_data_list", json=[group(9, 0, 3)] * 4).status_code == 429  # 4 + 16 > 16
        fleet = report("cartpole", 5.0, figures("w0", 640), figures("w1", 64, restarts=1, version=None))
        assert c.post("/fleet", json=fleet).status_code == 200
        run = run_report(run_figures()).model_dump_json()
        assert c.post("/fleet", content=run, headers={"Content-Type": "application/json"}).status_code == 200
        text = c.get("/metrics").text
    assert 'rollhub_stale_dropped_total{env_id="0",env="gamma \\"quoted\\""} 1' in text
    assert 'rollhub_run_engine_idle_fraction{fleet="llm",engine="0"} 0.75' in text
    return text


def test_metrics_page_is_prometheus_text_with_help_and_type_for_every_family(page: str) -> None:
    typed = dict(re.findall(r"^# TYPE (\S+) (\S+)$", page, re.M))
    helped = set(re.findall(r"^# HELP (\S+) \S", page, re.M))
    assert typed and set(typed) == helped
    for name, kind in typed.items():
        assert name.startswith("rollhub_"), name
        assert kind in {"counter", "gauge", "histogram"}, (name, kind)
        assert (kind == "counter") == name.endswith("_total"), f"{name} is a {kind}"
    families = list(text_string_to_metric_families(page))
    for family in families:
        for s in family.samples:
            base = next(
                (s.name[: -len(x)] for x in SUFFIXES if s.name.endswith(x) and s.name[: -len(x)] in typed), None
            )
            assert s.name in typed or base is not None, f"{s.name} has no TYPE line"
            assert s.value >= 0, s
    for family in (f for f in families if f.type == "histogram"):
        series: dict[frozenset[tuple[str, str]], list[tuple[float, float]]] = defaultdict(list)
        counts = {}
        for s in family.samples:
            rest = frozenset((k, v) for k, v in s.labels.items() if k != "le")
            if s.name.endswith("_bucket"):
                series[rest].append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                counts[rest] = s.value
        for labels, points in series.items():
            values = [v for _, v in sorted(points)]
            assert values == sorted(values), f"{family.name} buckets are not cumulative"
            assert sorted(points)[-1][0] == float("inf") and values[-1] == counts[labels], family.name
    names = {f.name for f in families}
    assert {"rollhub_served_staleness_versions", "rollhub_served_item_age_seconds"} <= names


def test_metrics_count_refusals_expiries_and_stale_drops(page: str) -> None:
    figures = {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples if not s.labels}
    assert figures["rollhub_refused_full_total"] == 1
    assert figures["rollhub_lease_expiries_total"] == 1
    assert figures["rollhub_served_staleness_versions_count"] == 8  # 2 leased + 2 again + 2 + 2
    assert figures["rollhub_served_item_age_seconds_count"] == 6  # redeliveries are not aged again


def test_grafana_board_queries_only_emitted_metrics_and_labels(page: str) -> None:
    labels: dict[str, set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            labels[s.name] |= set(s.labels)
    board = json.loads(BOARD.read_text())
    assert board["schemaVersion"] >= 39
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    targets: list[tuple[str, str]] = []
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            targets.append((target["expr"], target.get("legendFormat", "")))
    assert len(targets) >= 12
    for expr, legend in targets:
        used = set(re.findall(r"\brollhub_[A-Za-z0-9_]+", expr))
        assert used, expr
        missing = used - set(labels)
        assert not missing, f"{expr} uses {missing}, which /metrics does not emit"
        groupings = re.findall(r"\b(?:by|ignoring|on) ?\(([^)]*)\)", expr)
        named = [x.strip() for grouping in groupings for x in grouping.split(",")]
        named += re.findall(r"([A-Za-z_]\w*) *=~? *\"", expr)  # the label matchers
        named += re.findall(r"\{\{ *(\w+) *\}\}", legend)
        for label in named:
            assert any(label in labels[name] for name in used), f"{expr} names the label {label}, which no metric has"


def board_names() -> Any:
    return sorted({m for p in json.loads(BOARD.read_text())["panels"] for m in re.findall(r"rollhub_\w+", str(p))})


def test_board_covers_the_bottleneck_and_staleness_questions() -> None:
    names = board_names()
    for needed in (
        "rollhub_ingested_sequences_total",
        "rollhub_served_sequences_total",
        "rollhub_queue_sequences",
        "rollhub_queue_groups",
        "rollhub_served_staleness_versions_bucket",
        "rollhub_served_item_age_seconds_bucket",
        "rollhub_refused_full_total",
        "rollhub_stale_dropped_total",
        "rollhub_lease_expiries_total",
        "rollhub_request_seconds_bucket",
        "rollhub_request_body_bytes_in_flight",
    ):
        assert needed in names, needed


def test_board_covers_the_fleet() -> None:
    names = board_names()
    for needed in (
        "rollhub_fleet_env_steps_total",
        "rollhub_fleet_inference_observations_total",
        "rollhub_fleet_forward_passes_total",
        "rollhub_fleet_phase_seconds_total",
        "rollhub_fleet_worker_weight_version",
        "rollhub_fleet_worker_restarts_total",
        "rollhub_fleet_env_restarts_total",
    ):
        assert needed in names, needed
    ids = [p["id"] for p in json.loads(BOARD.read_text())["panels"]]
    assert len(ids) == len(set(ids))


def test_board_covers_the_run_figures() -> None:
    names = board_names()
    for needed in (
        "rollhub_run_partial_groups_ratio",
        "rollhub_run_partial_samples_ratio",
        "rollhub_run_trained_groups_total",
        "rollhub_run_group_version_span_bucket",
        "rollhub_run_trainer_wait_seconds_bucket",
        "rollhub_run_engine_idle_fraction",
        "rollhub_run_engine_reads_total",
        "rollhub_fleet_dropped_groups_total",
        "rollhub_fleet_aborted_groups_total",
        "rollhub_run_trainer_stale_groups_total",
    ):
        assert needed in names, needed
