"""A fleet's status as a report and as Prometheus text: exact lines, counters that survive worker restarts, and
statuses with missing or malformed fields."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from rollhub.observe.fleet_metrics import Received, mean_batch, prometheus_lines, to_json
from rollhub.observe.fleet_report import FleetReport, FleetStatusError, FleetTotals
from rollhub.rollout.stats import STAGES, PipelineMonitor

PHASES = ("recv_obs", "inference", "send_actions")


def worker(worker_id: str, steps: float, *, version: int | None = 3, state: str = "running", **extra: Any) -> dict:
    """One ``RolloutWorker.info()`` with a pipeline of ``steps`` environment steps (4 per forward pass)."""
    pipeline = {
        "turns": steps / 4,
        "env_steps": steps,
        "recv_obs_s": steps / 100,
        "recv_obs_ms_per_turn": 0.4,
        "inference_s": steps / 50,
        "inference_ms_per_turn": 0.8,
        "send_actions_s": steps / 200,
        "send_actions_ms_per_turn": 0.2,
        "steps_per_s": 1000.0,
        "forward_passes": steps / 4,
        "inference_obs": steps,
        "mean_inference_batch": 4.0,
    }
    info = {
        "worker_id": worker_id,
        "state": state,
        "error": None,
        "loaded_version": version,
        "items_sent": int(steps // 32),
        "dropped_steps": 2,
        "turns": int(steps / 4),
        "pace_waits": 1,
        "pipeline": pipeline,
        "env_restarts": 0,
        "events": [],
    }
    info.update(extra)
    return info


def dead(slot: int) -> dict:
    """What the fleet lists for a worker that does not answer."""
    return {"worker_id": f"w{slot}", "state": "dead", "error": "GetTimeoutError"}


EXPECTED = """\
# HELP rollhub_fleet_env_steps_total Environment steps taken, per worker slot.
# TYPE rollhub_fleet_env_steps_total counter
rollhub_fleet_env_steps_total{fleet="cartpole",worker="w0"} 400
rollhub_fleet_env_steps_total{fleet="cartpole",worker="w1"} 0
# HELP rollhub_fleet_turns_total Pipeline turns (observations in, forward pass, actions out), per worker slot.
# TYPE rollhub_fleet_turns_total counter
rollhub_fleet_turns_total{fleet="cartpole",worker="w0"} 100
rollhub_fleet_turns_total{fleet="cartpole",worker="w1"} 0
# HELP rollhub_fleet_forward_passes_total Policy forward passes (inference batches), per worker slot.
# TYPE rollhub_fleet_forward_passes_total counter
rollhub_fleet_forward_passes_total{fleet="cartpole",worker="w0"} 100
rollhub_fleet_forward_passes_total{fleet="cartpole",worker="w1"} 0
# HELP rollhub_fleet_inference_observations_total Observations over all forward passes, per worker slot; \
over forward passes: the mean inference batch.
# TYPE rollhub_fleet_inference_observations_total counter
rollhub_fleet_inference_observations_total{fleet="cartpole",worker="w0"} 400
rollhub_fleet_inference_observations_total{fleet="cartpole",worker="w1"} 0
# HELP rollhub_fleet_items_sent_total Items (fragments or groups) the writer acknowledged, per worker slot.
# TYPE rollhub_fleet_items_sent_total counter
rollhub_fleet_items_sent_total{fleet="cartpole",worker="w0"} 12
rollhub_fleet_items_sent_total{fleet="cartpole",worker="w1"} 0
# HELP rollhub_fleet_dropped_steps_total Steps dropped as too stale before sending, per worker slot.
# TYPE rollhub_fleet_dropped_steps_total counter
rollhub_fleet_dropped_steps_total{fleet="cartpole",worker="w0"} 2
rollhub_fleet_dropped_steps_total{fleet="cartpole",worker="w1"} 0
# HELP rollhub_fleet_pace_waits_total Turns spent waiting for new weights (pacing), per worker slot.
# TYPE rollhub_fleet_pace_waits_total counter
rollhub_fleet_pace_waits_total{fleet="cartpole",worker="w0"} 1
rollhub_fleet_pace_waits_total{fleet="cartpole",worker="w1"} 0
# HELP rollhub_fleet_env_restarts_total Environment processes restarted, per worker slot.
# TYPE rollhub_fleet_env_restarts_total counter
rollhub_fleet_env_restarts_total{fleet="cartpole",worker="w0"} 0
rollhub_fleet_env_restarts_total{fleet="cartpole",worker="w1"} 0
# HELP rollhub_fleet_dropped_groups_total Groups not sampled on too stale weights, per worker slot.
# TYPE rollhub_fleet_dropped_groups_total counter
rollhub_fleet_dropped_groups_total{fleet="cartpole",worker="w0"} 0
rollhub_fleet_dropped_groups_total{fleet="cartpole",worker="w1"} 0
# HELP rollhub_fleet_aborted_groups_total Groups left out for an aborted completion, per worker slot.
# TYPE rollhub_fleet_aborted_groups_total counter
rollhub_fleet_aborted_groups_total{fleet="cartpole",worker="w0"} 0
rollhub_fleet_aborted_groups_total{fleet="cartpole",worker="w1"} 0
# HELP rollhub_fleet_worker_restarts_total Workers the fleet replaced (died or failed), per worker slot.
# TYPE rollhub_fleet_worker_restarts_total counter
rollhub_fleet_worker_restarts_total{fleet="cartpole",worker="w0"} 0
rollhub_fleet_worker_restarts_total{fleet="cartpole",worker="w1"} 2
# HELP rollhub_fleet_phase_seconds_total Seconds spent per pipeline phase, per worker.
# TYPE rollhub_fleet_phase_seconds_total counter
rollhub_fleet_phase_seconds_total{fleet="cartpole",worker="w0",phase="inference"} 8.0
rollhub_fleet_phase_seconds_total{fleet="cartpole",worker="w0",phase="recv_obs"} 4.0
rollhub_fleet_phase_seconds_total{fleet="cartpole",worker="w0",phase="send_actions"} 2.0
rollhub_fleet_phase_seconds_total{fleet="cartpole",worker="w1",phase="inference"} 0.0
rollhub_fleet_phase_seconds_total{fleet="cartpole",worker="w1",phase="recv_obs"} 0.0
rollhub_fleet_phase_seconds_total{fleet="cartpole",worker="w1",phase="send_actions"} 0.0
# HELP rollhub_fleet_worker_weight_version Weight version the worker has loaded (absent until it loaded one).
# TYPE rollhub_fleet_worker_weight_version gauge
rollhub_fleet_worker_weight_version{fleet="cartpole",worker="w0"} 3
# HELP rollhub_fleet_worker_info The worker now in each slot (id) and its state: always 1.
# TYPE rollhub_fleet_worker_info gauge
rollhub_fleet_worker_info{fleet="cartpole",worker="w0",id="w0",state="running"} 1
rollhub_fleet_worker_info{fleet="cartpole",worker="w1",id="w1",state="dead"} 1
# HELP rollhub_fleet_workers Worker slots per state.
# TYPE rollhub_fleet_workers gauge
rollhub_fleet_workers{fleet="cartpole",state="dead"} 1
rollhub_fleet_workers{fleet="cartpole",state="running"} 1
# HELP rollhub_fleet_reporter_errors_total Fleet status reads and report posts that failed.
# TYPE rollhub_fleet_reporter_errors_total counter
rollhub_fleet_reporter_errors_total{fleet="cartpole",kind="status"} 1
rollhub_fleet_reporter_errors_total{fleet="cartpole",kind="post"} 0
# HELP rollhub_fleet_report_age_seconds Seconds since the fleet's last report arrived.
# TYPE rollhub_fleet_report_age_seconds gauge
rollhub_fleet_report_age_seconds{fleet="cartpole"} 1.5
"""


def test_a_status_becomes_exactly_these_prometheus_lines() -> None:
    status = {"workers": [worker("w0", 400.0), dead(1)], "restarts": [0, 2], "events": []}
    report = FleetTotals("cartpole", PHASES).update(status, now=1000.0, status_errors=1)
    lines = prometheus_lines([Received(report, age_s=1.5)])
    assert "\n".join(lines) + "\n" == EXPECTED
    families = {f.name: f for f in text_string_to_metric_families(EXPECTED)}  # the parser accepts the page
    assert families["rollhub_fleet_env_steps"].type == "counter"
    assert families["rollhub_fleet_worker_weight_version"].type == "gauge"


def test_no_reports_no_lines_and_a_live_report_has_no_age() -> None:
    assert prometheus_lines([]) == []
    report = FleetTotals("f", PHASES).update({"workers": [worker("w0", 8.0)]}, now=1.0)
    lines = prometheus_lines([Received(report)])
    assert not any("report_age_seconds" in line for line in lines)
    assert 'rollhub_fleet_env_steps_total{fleet="f",worker="w0"} 8' in lines


def test_the_reported_phases_are_the_pipeline_monitors_stages() -> None:
    monitor = PipelineMonitor()
    monitor.add({"recv_obs": 0.25, "inference": 0.5, "send_actions": 0.125}, env_steps=6, inference_batch=3)
    monitor.add({"recv_obs": 0.25, "inference": 0.5, "send_actions": 0.125}, env_steps=6, inference_batch=3)
    info = {"worker_id": "w0", "state": "running", "loaded_version": 0, "pipeline": monitor.snapshot()}
    report = FleetTotals("f", STAGES).update({"workers": [info]}, now=1.0)
    w = report.workers[0]
    assert w.phase_seconds == {"recv_obs": 0.5, "inference": 1.0, "send_actions": 0.25}
    assert (w.env_steps, w.turns, w.forward_passes, w.inference_observations) == (12, 2, 2, 6)
    assert mean_batch(w) == 3.0


def test_counters_of_a_slot_carry_over_its_worker_restarts_and_never_fall() -> None:
    totals = FleetTotals("f", PHASES)
    first = totals.update({"workers": [worker("w0", 100.0, env_restarts=1)], "restarts": [0]}, now=1.0)
    gone = totals.update({"workers": [dead(0)], "restarts": [0]}, now=2.0)
    again = totals.update({"workers": [worker("w0r1", 20.0, version=None)], "restarts": [1]}, now=3.0)
    later = totals.update({"workers": [worker("w0r1", 60.0, env_restarts=2, version=5)], "restarts": [1]}, now=4.0)
    steps = [r.workers[0].env_steps for r in (first, gone, again, later)]
    assert steps == [100, 100, 120, 160]
    assert [r.workers[0].env_restarts for r in (first, gone, again, later)] == [1, 1, 1, 3]
    assert [r.workers[0].id for r in (first, gone, again, later)] == ["w0", "w0", "w0r1", "w0r1"]
    assert [r.workers[0].state for r in (first, gone, again, later)] == ["running", "dead", "running", "running"]
    assert [r.workers[0].weight_version for r in (first, gone, again, later)] == [3, None, None, 5]
    assert [r.workers[0].restarts for r in (first, gone, again, later)] == [0, 0, 1, 1]
    assert later.workers[0].phase_seconds["inference"] == pytest.approx(2.0 + 1.2)
    assert all(r.workers[0].worker == "w0" for r in (first, gone, again, later))


def test_a_worker_whose_counts_start_over_under_the_same_id_is_carried_too() -> None:
    totals = FleetTotals("f", PHASES)
    totals.update({"workers": [worker("w0", 80.0)]}, now=1.0)
    assert totals.update({"workers": [worker("w0", 8.0)]}, now=2.0).workers[0].env_steps == 88


def test_missing_and_malformed_fields_keep_their_last_value() -> None:
    totals = FleetTotals("f", PHASES)
    totals.update({"workers": [worker("w0", 40.0)]}, now=1.0)
    broken = worker("w0", 48.0, items_sent="7", pace_waits=True, dropped_steps=-3, env_restarts=math.nan)
    del broken["pipeline"]["forward_passes"]
    broken["pipeline"]["inference_s"] = math.inf
    totals.update({"workers": [worker("w0", 44.0)], "restarts": [2]}, now=1.5)
    w = totals.update({"workers": [broken], "restarts": "many"}, now=2.0).workers[0]
    assert w.env_steps == 48  # what is there counts
    assert (w.items_sent, w.pace_waits, w.dropped_steps, w.env_restarts) == (1, 1, 2, 0)  # the last good values
    assert w.forward_passes == 11 and w.phase_seconds["inference"] == pytest.approx(0.88)
    assert w.restarts == 2


def test_a_worker_entry_that_is_not_a_dict_or_has_odd_names_is_still_reported() -> None:
    odd = worker('w 1"x', 4.0, state="Running!", version=True)
    accented = worker("w2", 4.0, state="d\u00e9marr\u00e9")
    report = FleetTotals("f", PHASES).update({"workers": ["garbage", odd, {}, accented]}, now=1.0)
    ids = [(w.worker, w.id, w.state, w.weight_version) for w in report.workers]
    assert ids == [
        ("w0", "w0", "unknown", None),
        ("w1", "w_1_x", "unknown", None),
        ("w2", "w2", "unknown", None),
        ("w3", "w2", "unknown", 3),
    ]
    assert report.workers[1].env_steps == 4


@pytest.mark.parametrize("status", [None, [], {"restarts": [0]}, {"workers": {"w0": {}}}])
def test_a_status_without_a_workers_list_is_refused_with_what_to_pass(status: Any) -> None:
    with pytest.raises(FleetStatusError, match="no 'workers' list"):
        FleetTotals("f", PHASES).update(status, now=1.0)


def test_bad_fleet_and_phase_names_are_refused_up_front() -> None:
    with pytest.raises(FleetStatusError, match="fleet name"):
        FleetTotals("a\nb", PHASES)
    with pytest.raises(FleetStatusError, match="fleet name"):
        FleetTotals("x" * 129, PHASES)
    with pytest.raises(FleetStatusError, match="phase names"):
        FleetTotals("f", ("Recv Obs",))


def test_label_values_are_escaped() -> None:
    report = FleetTotals('run "a" \\ b', PHASES).update({"workers": [worker("w0", 4.0)]}, now=1.0)
    text = "\n".join(prometheus_lines([Received(report)])) + "\n"
    assert 'rollhub_fleet_env_steps_total{fleet="run \\"a\\" \\\\ b",worker="w0"} 4' in text
    fleets = {s.labels["fleet"] for f in text_string_to_metric_families(text) for s in f.samples}
    assert fleets == {'run "a" \\ b'}


def test_dashboard_json_has_every_field_the_age_and_the_mean_batch() -> None:
    report = FleetTotals("f", PHASES).update({"workers": [worker("w0", 40.0), dead(1)]}, now=5.0)
    data = to_json(Received(report, age_s=2.0))
    assert data["fleet"] == "f" and data["time"] == 5.0 and data["age_s"] == 2.0
    assert [w["mean_batch"] for w in data["workers"]] == [4.0, None]
    assert data["workers"][0]["phase_seconds"] == {"recv_obs": 0.4, "inference": 0.8, "send_actions": 0.2}


GOOD: dict[str, Any] = {
    "fleet": "f",
    "time": 10.0,
    "workers": [
        {
            "worker": "w0",
            "id": "w0",
            "state": "running",
            "weight_version": 1,
            "env_steps": 8,
            "turns": 2,
            "forward_passes": 2,
            "inference_observations": 8,
            "items_sent": 0,
            "dropped_steps": 0,
            "pace_waits": 0,
            "env_restarts": 0,
            "restarts": 0,
            "phase_seconds": {"inference": 0.5},
        }
    ],
}


def with_worker(**changes: Any) -> dict[str, Any]:
    return {**GOOD, "workers": [{**GOOD["workers"][0], **changes}]}


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        (with_worker(env_steps=-1), ("workers", 0, "env_steps")),
        (with_worker(env_steps=True), ("workers", 0, "env_steps")),
        (with_worker(env_steps="8"), ("workers", 0, "env_steps")),
        (with_worker(env_steps=8.5), ("workers", 0, "env_steps")),
        (with_worker(phase_seconds={"inference": -0.5}), ("workers", 0, "phase_seconds", "inference")),
        (with_worker(phase_seconds={"Bad Phase": 0.5}), ("workers", 0, "phase_seconds", "Bad Phase", "[key]")),
        (with_worker(worker='w"0'), ("workers", 0, "worker")),
        (with_worker(colour="red"), ("workers", 0, "colour")),
        ({**GOOD, "workers": GOOD["workers"] * 2}, ("workers",)),
        ({**GOOD, "time": math.nan}, ("time",)),
        ({**GOOD, "fleet": ""}, ("fleet",)),
        ({k: v for k, v in GOOD.items() if k != "workers"}, ("workers",)),
    ],
)
def test_a_report_that_breaks_the_contract_names_the_field(body: dict[str, Any], loc: tuple[Any, ...]) -> None:
    FleetReport.model_validate(GOOD)
    with pytest.raises(ValidationError) as caught:
        FleetReport.model_validate(body)
    assert [e["loc"] for e in caught.value.errors()] == [loc]
