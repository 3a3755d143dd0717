"""The run's fleet reporter: posts a fake fleet's reports to a real ``rollhub serve`` and serves them on its own
metrics port; a fleet or a server that fails is counted and logged once, never fatal; it stops cleanly."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollhub.run.config import RunConfigError, load_config, read_toml
from rollhub.run.fleet_reporter import FleetReporter, report_fleet
from tests.conftest import ServerProcess, free_port
from tests.run.run_process import CORRIDOR

KEY = "k-reporter"


class FakeFleet:
    """A fleet of two workers whose steps grow by 32 on every ``status()``; the first ``fail_first`` calls raise,
    and each call waits for ``gate`` when one is given."""

    def __init__(self, fail_first: int = 0, gate: threading.Event | None = None) -> None:
        self.calls = 0
        self.fail_first = fail_first
        self.gate = gate

    def status(self) -> dict[str, Any]:
        if self.gate is not None:
            self.gate.wait()
        self.calls += 1
        if self.calls <= self.fail_first:
            raise RuntimeError("the fleet actor did not answer")
        steps = 32.0 * self.calls
        return {"workers": [self.info("w0", steps), self.info("w1r1", steps / 2)], "restarts": [0, 1], "events": []}

    @staticmethod
    def info(worker_id: str, steps: float) -> dict[str, Any]:
        pipeline = {"env_steps": steps, "turns": steps / 4, "forward_passes": steps / 4, "inference_obs": steps}
        pipeline |= {"recv_obs_s": steps / 1000, "inference_s": steps / 500, "send_actions_s": steps / 2000}
        return {
            "worker_id": worker_id,
            "state": "running",
            "loaded_version": 1,
            "items_sent": int(steps // 32),
            "dropped_steps": 0,
            "pace_waits": 0,
            "env_restarts": 0,
            "pipeline": pipeline,
        }


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(url, headers=headers or {}, timeout=30).text
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def steps_of(figures: dict[tuple[str, frozenset[tuple[str, str]]], float], fleet: str, worker: str) -> float:
    return figures.get(("rollhub_fleet_env_steps_total", frozenset({("fleet", fleet), ("worker", worker)})), 0.0)


def wait_for(what: str, check: Callable[[], bool], deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {deadline_s} s"
        time.sleep(0.05)


def refused(url: str) -> bool:
    try:
        httpx.get(url, timeout=5)
    except httpx.TransportError:
        return True
    return False


def test_reports_reach_the_server_and_the_metrics_port_then_it_stops(server_factory: type[ServerProcess]) -> None:
    server = server_factory("--storage", "memory", "--api-key", KEY).start()
    auth = {"Authorization": f"Bearer {KEY}"}
    reporter = FleetReporter(FakeFleet(), "cartpole", every_s=0.05, url=server.url, api_key=KEY,
                             metrics=("127.0.0.1", 0))  # fmt: skip
    assert reporter.metrics_url is not None and reporter.metrics_url.startswith("http://127.0.0.1:")
    with reporter.start():
        wait_for(
            "two reports on the server", lambda: steps_of(scrape(server.url + "/metrics", auth), "cartpole", "w0") >= 64
        )
        on_port = scrape(reporter.metrics_url)
        assert steps_of(on_port, "cartpole", "w0") >= 64 and steps_of(on_port, "cartpole", "w1") >= 32
        restarts = ("rollhub_fleet_worker_restarts_total", frozenset({("fleet", "cartpole"), ("worker", "w1")}))
        assert on_port[restarts] == 1
        assert httpx.get(reporter.metrics_url.replace("/metrics", "/other"), timeout=30).status_code == 404
        fleets = httpx.get(server.url + "/dashboard/data", headers=auth, timeout=30).json()["fleets"]
        assert [f["fleet"] for f in fleets] == ["cartpole"] and fleets[0]["workers"][1]["id"] == "w1r1"
    assert not reporter.running
    assert refused(reporter.metrics_url)
    assert reporter.errors == {"status": 0, "post": 0} and reporter.posted >= 2


def test_a_fleet_status_that_raises_is_counted_logged_once_and_reporting_goes_on(
    server_factory: type[ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    server = server_factory("--storage", "memory").start()
    fleet = FakeFleet(fail_first=3)
    errors = ("rollhub_fleet_reporter_errors_total", frozenset({("fleet", "flaky"), ("kind", "status")}))
    reporter = FleetReporter(fleet, "flaky", every_s=0.05, url=server.url)
    with caplog.at_level(logging.WARNING, logger="rollhub.run.fleet"), reporter.start():
        wait_for("a report after the failures", lambda: scrape(server.url + "/metrics").get(errors) == 3)
    assert reporter.errors["status"] == 3 and not reporter.running
    assert steps_of(scrape(server.url + "/metrics"), "flaky", "w0") >= 32 * 4
    warnings = [r.getMessage() for r in caplog.records if r.name == "rollhub.run.fleet"]
    assert len(warnings) == 1 and "the fleet actor did not answer" in warnings[0], warnings


@pytest.mark.parametrize("reason", ["no server", "wrong key"])
def test_a_server_that_refuses_or_is_gone_is_counted_and_the_port_still_serves(
    server_factory: type[ServerProcess], caplog: pytest.LogCaptureFixture, reason: str
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    if reason == "wrong key":
        url = server_factory("--storage", "memory", "--api-key", KEY).start().url
    with caplog.at_level(logging.WARNING, logger="rollhub.run.fleet"):
        reporter = FleetReporter(FakeFleet(), "lonely", every_s=0.05, url=url, api_key="wrong",
                                 metrics=("127.0.0.1", 0))  # fmt: skip
        with reporter.start():
            wait_for("three failed posts", lambda: reporter.errors["post"] >= 3)
            wait_for("the port's figures", lambda: steps_of(scrape(reporter.metrics_url or ""), "lonely", "w0") > 0)
    warnings = [r.getMessage() for r in caplog.records if r.name == "rollhub.run.fleet"]
    assert len(warnings) == 1 and url in warnings[0], warnings
    assert ("401" in warnings[0]) == (reason == "wrong key")
    assert reporter.posted == 0 and not reporter.running


def test_stop_returns_while_a_status_read_hangs() -> None:
    gate = threading.Event()
    reporter = FleetReporter(FakeFleet(gate=gate), "stuck", every_s=0.05, metrics=("127.0.0.1", 0)).start()
    wait_for("the port to answer", lambda: httpx.get(reporter.metrics_url or "", timeout=30).status_code == 200)
    reporter.stop(timeout_s=0.2)  # the status read is still waiting on the gate
    assert refused(reporter.metrics_url or "")
    gate.set()
    wait_for("the thread to end once the read returns", lambda: not reporter.running)


def test_a_metrics_port_in_use_is_a_config_error_naming_the_key() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RunConfigError, match=rf"run.metrics_port: cannot serve .* on 127.0.0.1:{port}"):
            FleetReporter(FakeFleet(), "x", metrics=("127.0.0.1", port))


def test_report_fleet_follows_the_run_section() -> None:
    off = SimpleNamespace(name="r", metrics_port=None, metrics_host="127.0.0.1", metrics_every_s=0.05)
    with report_fleet(off, FakeFleet()) as reporter:
        assert reporter is None
    port = free_port()
    on = SimpleNamespace(name="r", metrics_port=port, metrics_host="127.0.0.1", metrics_every_s=0.05)
    with report_fleet(on, FakeFleet()) as reporter:
        assert reporter is not None and reporter.metrics_url == f"http://127.0.0.1:{port}/metrics"
        wait_for("the port's figures", lambda: steps_of(scrape(f"http://127.0.0.1:{port}/metrics"), "r", "w0") > 0)
    assert not reporter.running and refused(f"http://127.0.0.1:{port}/metrics")


def test_the_run_keys_are_validated_with_their_path() -> None:
    data = read_toml(Path(CORRIDOR))
    config = load_config(data)
    assert (config.run.metrics_port, config.run.metrics_host, config.run.metrics_every_s) == (None, "127.0.0.1", 2.0)
    for sets, message in (
        (["run.metrics_port=70000"], "run.metrics_port: Input should be less than or equal to 65535"),
        (["run.metrics_port=-1"], "run.metrics_port: Input should be greater than or equal to 0"),
        (["run.metrics_every_s=0"], "run.metrics_every_s: Input should be greater than 0"),
        (['run.metrics_host=""'], "run.metrics_host: String should have at least 1 character"),
    ):
        with pytest.raises(RunConfigError, match=message):
            load_config(data, sets)
