"""``rollhub run`` reports its fleet: a step run (no buffer server; Ray or local fleet) serves the figures on
``run.metrics_port`` while it trains and closes the port when it ends; a group run writing to a buffer server
posts them there."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess, free_port
from tests.run.run_process import CORRIDOR, REPO, kill_tree, start_run

ECHO = REPO / "tests" / "run" / "echo_digit.toml"
ENDLESS = ["--set", "run.target_return=100.0", "--set", "run.max_updates=100000", "--set", "run.checkpoint_every=1000"]


def fleet_figures(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
    """The run's /metrics samples, or ``None`` while the port does not answer yet."""
    try:
        text = httpx.get(url, timeout=10).text
    except httpx.TransportError:
        return None
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


@pytest.mark.parametrize("backend", [pytest.param("ray", marks=pytest.mark.ray), "local", "processes"])
def test_a_step_run_serves_its_fleets_metrics_until_it_ends(tmp_path: Path, backend: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    log = tmp_path / "run.log"
    sets = ["--set", f"run.dir={str(tmp_path / 'run')!r}", "--set", f"run.metrics_port={port}"]
    sets += ["--set", "run.metrics_every_s=0.5", "--set", f"fleet.backend={backend!r}"]
    proc = start_run(str(CORRIDOR), *sets, *ENDLESS, log=log)
    w0 = frozenset({("fleet", "corridor"), ("worker", "w0")})
    try:
        deadline = time.monotonic() + 240
        figures = None
        while True:
            assert proc.poll() is None, f"the run exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no fleet steps on {url} within 240 s:\n{log.read_text()[-3000:]}"
            figures = fleet_figures(url)
            if figures and figures.get(("rollhub_fleet_env_steps_total", w0), 0) > 0:
                break
            time.sleep(0.5)
        inference = ("rollhub_fleet_phase_seconds_total", w0 | {("phase", "inference")})
        assert figures[inference] > 0
        assert figures[("rollhub_fleet_forward_passes_total", w0)] > 0
        assert figures[("rollhub_fleet_worker_restarts_total", w0)] == 0
        proc.send_signal(signal.SIGTERM)  # the run stops as on Ctrl-C: the reporter stops with it
        proc.wait(180)
    finally:
        kill_tree(proc)
    assert fleet_figures(url) is None, "the metrics port is still open after the run ended"


@pytest.mark.ray
def test_a_group_run_posts_its_fleets_reports_to_the_buffer_server(
    tmp_path: Path, server_factory: type[ServerProcess]
) -> None:
    server = server_factory("--storage", "memory").start()
    log = tmp_path / "run.log"
    sets = ["--set", f"run.dir={str(tmp_path / 'run')!r}", "--set", 'writer.kind="server"']
    sets += ["--set", f"writer.url={server.url!r}", "--set", "fleet.workers=1", "--set", "run.metrics_every_s=0.5"]
    proc = start_run(str(ECHO), *sets, "--set", "eval.target_accuracy=1.1", log=log)
    w0 = frozenset({("fleet", "echo"), ("worker", "w0")})
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"the run exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"no fleet report on the server within 240 s:\n{log.read_text()[-3000:]}"
            )
            figures = fleet_figures(server.url + "/metrics") or {}
            if figures.get(("rollhub_fleet_env_steps_total", w0), 0) > 0:
                break
            time.sleep(0.5)
        assert figures[("rollhub_fleet_items_sent_total", w0)] >= 0
        assert figures[("rollhub_fleet_report_age_seconds", frozenset({("fleet", "echo")}))] >= 0
        proc.send_signal(signal.SIGTERM)
        proc.wait(180)
    finally:
        kill_tree(proc)
