"""A run's own figures in a fleet report: histograms, their Prometheus text (parsed back), the dashboard's JSON,
the report's wire round trip, and the trainer-wait summary."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from rollhub.observe.fleet_metrics import Received, prometheus_lines, to_json
from rollhub.observe.fleet_report import FleetReport, FleetTotals
from rollhub.observe.run_figures import (
    SPAN_BOUNDS,
    WAIT_BOUNDS,
    BucketCounter,
    Buckets,
    EngineReads,
    RunFigures,
    wait_summary,
)


def figures(**changes: object) -> RunFigures:
    waits = BucketCounter(WAIT_BOUNDS)
    for seconds in (0.02, 0.3, 0.3, 70.0):
        waits.observe(seconds)
    values = {
        "trained_groups": {"partial": 3, "whole": 5, "unknown": 2},
        "trained_samples": {"partial": 6, "whole": 26, "unknown": 8},
        "version_span": Buckets.of(SPAN_BOUNDS, {0: 5, 1: 2, 5: 1}),
        "trainer_wait_seconds": waits.buckets(),
        "trainer_stale_groups": 4,
        "engines": [EngineReads(engine="0", idle=3, busy=1, unanswered=2), EngineReads(engine="1", unanswered=5)],
    }
    return RunFigures(**{**values, **changes})  # type: ignore[arg-type]


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def report(run: RunFigures | None) -> FleetReport:
    """A report as a group run's reporter makes it (:class:`FleetTotals`): fleet ``llm``, no workers, ``run``."""
    return FleetTotals("llm", ("inference",)).update({"workers": []}, now=1000.0, run=run)


RUN = frozenset({("fleet", "llm")})


def test_the_run_figures_become_prometheus_families_that_parse_back() -> None:
    got = samples("\n".join(prometheus_lines([Received(report(figures()))])) + "\n")
    for kind, n in (("partial", 3), ("whole", 5), ("unknown", 2)):
        assert got[("rollhub_run_trained_groups_total", RUN | {("versions", kind)})] == n
    assert got[("rollhub_run_trained_samples_total", RUN | {("versions", "partial")})] == 6
    assert got[("rollhub_run_partial_groups_ratio", RUN)] == pytest.approx(3 / 8)  # the unknown left out
    assert got[("rollhub_run_partial_samples_ratio", RUN)] == pytest.approx(6 / 32)
    span = [got[("rollhub_run_group_version_span_bucket", RUN | {("le", le)})] for le in ("0", "1", "2", "8", "+Inf")]
    assert span == [5, 7, 7, 8, 8]  # cumulative; a span of 5 falls in le="8"
    assert got[("rollhub_run_group_version_span_count", RUN)] == 8
    assert got[("rollhub_run_group_version_span_sum", RUN)] == 7
    assert got[("rollhub_run_trainer_wait_seconds_bucket", RUN | {("le", "0.05")})] == 1
    assert got[("rollhub_run_trainer_wait_seconds_bucket", RUN | {("le", "300")})] == 4
    assert got[("rollhub_run_trainer_wait_seconds_count", RUN)] == 4
    assert got[("rollhub_run_trainer_stale_groups_total", RUN)] == 4
    engine0 = RUN | {("engine", "0")}
    assert got[("rollhub_run_engine_reads_total", engine0 | {("state", "idle")})] == 3
    assert got[("rollhub_run_engine_reads_total", engine0 | {("state", "unanswered")})] == 2
    assert got[("rollhub_run_engine_idle_fraction", engine0)] == 0.75
    assert ("rollhub_run_engine_idle_fraction", RUN | {("engine", "1")}) not in got  # never answered


def test_nothing_known_leaves_the_ratios_out_and_a_report_without_run_figures_has_no_run_families() -> None:
    unknown = figures(trained_groups={"partial": 0, "whole": 0, "unknown": 4}, engines=[])
    names = {name for name, _ in samples("\n".join(prometheus_lines([Received(report(unknown))])) + "\n")}
    assert "rollhub_run_trained_groups_total" in names and "rollhub_run_partial_groups_ratio" not in names
    plain = "\n".join(prometheus_lines([Received(report(None))]))
    assert "rollhub_run_" not in plain


def test_the_report_round_trips_as_json_and_the_dashboard_gets_ratios_and_idle_fractions() -> None:
    sent = report(figures())
    assert FleetReport.model_validate_json(sent.model_dump_json()) == sent
    run = to_json(Received(sent, age_s=1.0))["run"]
    assert run["partial_groups_ratio"] == pytest.approx(3 / 8)
    assert [e["idle_fraction"] for e in run["engines"]] == [0.75, None]
    assert run["version_span"]["counts"] == [5, 2, 0, 0, 0, 1, 0]
    older = sent.model_dump(mode="json")
    del older["run"]
    assert FleetReport.model_validate(older).run is None  # a reporter without run figures still validates


@pytest.mark.parametrize(
    ("buckets", "message"),
    [
        ({"le": [0, 1], "counts": [1, 2]}, "counts has 2 values for 2 bounds"),
        ({"le": [1, 1], "counts": [0, 0, 0]}, "le must be strictly ascending"),
        ({"le": [0], "counts": [-1, 0]}, "greater than or equal to 0"),
    ],
)
def test_malformed_buckets_are_refused(buckets: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Buckets.model_validate(buckets)


def test_the_wait_summary_gives_median_p95_and_max() -> None:
    waits = [0.1] * 18 + [2.0, 9.0]
    assert wait_summary(waits) == {"median": 0.1, "p95": 2.0, "max": 9.0, "updates": 20}
    assert wait_summary([]) == {"median": None, "p95": None, "max": None, "updates": 0}
    assert wait_summary([3.0])["p95"] == 3.0
