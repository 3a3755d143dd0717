"""The run's fleet reporter: every few seconds it reads ``fleet.status()`` and makes it a fleet report
(:mod:`rollhub.observe.fleet_report`) that it posts to the buffer server (``POST /fleet``, on a group run that
writes to one) and serves as Prometheus text on the run's own metrics port (``run.metrics_port``), so that a step
run, which has no server, can be scraped too. A group run adds its own figures to every report
(:mod:`rollhub.run.run_metrics`: the ``rollhub_run_*`` families), and a group run without rollout workers (a
trainer-only or an in-process run) reports those alone.

The reporter never stops or slows the run: it works in a thread of its own, a status read or a post that fails
is counted (``rollhub_fleet_reporter_errors_total``) and logged once per kind, and :meth:`FleetReporter.stop`
returns within a bounded time whatever the fleet or the server do. Only a metrics port that cannot be bound is an
error, raised at start, before the run trains.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rollhub.observe.fleet_metrics import Received, prometheus_lines
from rollhub.observe.fleet_report import FleetReport, FleetTotals
from rollhub.observe.run_figures import RunFigures
from rollhub.rollout.protocols import Fleet
from rollhub.rollout.stats import STAGES
from rollhub.run.config import RunConfigError, RunSection

log = logging.getLogger("rollhub.run.fleet")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class FleetReporter:
    """Reads ``fleet.status()`` every ``every_s`` seconds; posts and serves the fleet's report.

    Args:
        fleet: the fleet whose ``status()`` is reported (``None``: a run without rollout workers, whose reports
            carry no workers).
        name: the fleet's name in its reports (the run's name).
        every_s: seconds between status reads.
        url: the buffer server to post each report to (``None``: none).
        api_key: sent as ``Authorization: Bearer`` (default ``$ROLLHUB_API_KEY``).
        metrics: ``(host, port)`` to serve ``/metrics`` on (port 0: any free port); ``None``: no port.
        clock: wall-clock seconds stamped on each report.
        run: the run's own figures for each report (``FleetReport.run``; ``None``: none).
    """

    def __init__(self, fleet: Fleet | None, name: str, *, every_s: float = 2.0, url: str | None = None,
                 api_key: str | None = None, metrics: tuple[str, int] | None = None,
                 clock: Callable[[], float] = time.time,
                 run: Callable[[], RunFigures] | None = None) -> None:  # fmt: skip
        self.fleet = fleet
        self.run = run
        self.totals = FleetTotals(_fleet_name(name), STAGES)
        self.every_s = every_s
        self.url = None if url is None else url.rstrip("/") + "/fleet"
        self.clock = clock
        self.latest: FleetReport | None = None
        self.errors = {"status": 0, "post": 0}
        self.posted = 0
        self.ticks = 0
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fleet-reporter", daemon=True)
        self._serving = False
        self._http: ThreadingHTTPServer | None = None
        if metrics is not None:
            self._http = _metrics_server(metrics, self.text)
        self._client = None if url is None else _client(api_key)

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics`` of the metrics port (``None`` without one)."""
        if self._http is None:
            return None
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}/metrics"

    @property
    def running(self) -> bool:
        """Whether the reporting thread is still alive."""
        return self._thread.is_alive()

    def __enter__(self) -> FleetReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> FleetReporter:
        """Start reporting (and serving the metrics port); returns ``self``."""
        if self._http is not None:
            threading.Thread(target=self._http.serve_forever, name="fleet-metrics", daemon=True).start()
            self._serving = True
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop reporting and close the metrics port; waits at most about ``timeout_s`` for a status read or a post
        in progress (the thread is a daemon: it never holds the process)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._client is not None and not self._thread.is_alive():  # else a post is still under way
            self._client.close()
        if self._http is not None:
            if self._serving:
                self._http.shutdown()
            self._http.server_close()

    def text(self) -> str:
        """The latest report as Prometheus text (empty before the first one)."""
        latest = self.latest
        return "" if latest is None else "\n".join(prometheus_lines([Received(latest)])) + "\n"

    def tick(self) -> None:
        """One round: read the status, make the report, post it."""
        report = self._report()
        if report is not None:
            self.latest = report
            self._post(report)
        self.ticks += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.every_s)

    def _report(self) -> FleetReport | None:
        try:
            status = self.fleet.status() if self.fleet is not None else {"workers": []}
            figures = self.run() if self.run is not None else None
            return self.totals.update(status, self.clock(), self.errors["status"], self.errors["post"], figures)
        except Exception as exc:  # whatever the fleet does, the run goes on
            self._failed("status", f"reading the fleet's status failed ({type(exc).__name__}: {exc})")
            return None

    def _post(self, report: FleetReport) -> None:
        if self._client is None or self.url is None or self._stop.is_set():
            return
        import httpx

        try:
            answer = self._client.post(self.url, content=report.model_dump_json(),
                                       headers={"Content-Type": "application/json"})  # fmt: skip
        except httpx.HTTPError as exc:
            self._failed("post", f"posting to {self.url} failed ({type(exc).__name__}: {exc})")
            return
        if answer.status_code >= 400:
            self._failed("post", f"{self.url} answered {answer.status_code}: {answer.text[:300]}")
        else:
            self.posted += 1

    def _failed(self, kind: str, why: str) -> None:
        self.errors[kind] += 1
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("fleet reporter: %s; the run goes on, later failures of this kind are only counted "
                        "(rollhub_fleet_reporter_errors_total{kind=%r})", why, kind)  # fmt: skip


def _client(api_key: str | None) -> Any:
    """The HTTP client of the posts (httpx is imported only by a reporter that posts: a run's start stays fast)."""
    import httpx

    from rollhub.client._http import API_KEY_ENV

    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    return httpx.Client(timeout=10.0, headers={"Authorization": f"Bearer {key}"} if key else {})


def _fleet_name(name: str) -> str:
    cleaned = "".join(c for c in name if c.isprintable())[:128]
    return cleaned or "run"


def _metrics_server(address: tuple[str, int], text: Callable[[], str]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                body, status, kind = b"not found: the fleet's metrics are at /metrics\n", 404, "text/plain"
            else:
                body, status, kind = text().encode(), 200, CONTENT_TYPE
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a scrape every few seconds is not worth a log line

    host, port = address
    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        raise RunConfigError(
            f"run.metrics_port: cannot serve the fleet's metrics on {host}:{port} ({exc.strerror or exc}); "
            "pick a free port, fix run.metrics_host, or set run.metrics_port = 0 to switch the port off"
        ) from None
    server.daemon_threads = True
    return server


@contextlib.contextmanager
def report_fleet(run: RunSection, fleet: Fleet | None, url: str | None = None,
                 figures: Callable[[], RunFigures] | None = None) -> Iterator[FleetReporter | None]:  # fmt: skip
    """Report ``fleet`` (``None``: no workers) and the run's ``figures`` for the run whose ``[run]`` section is
    ``run`` while the block runs: to the server at ``url`` when given, and on ``run.metrics_port`` when set (0 or
    absent: off). Yields ``None`` when neither."""
    port = run.metrics_port or 0
    if url is None and not port:
        yield None
        return
    metrics = (run.metrics_host, port) if port else None
    reporter = FleetReporter(fleet, run.name, every_s=run.metrics_every_s, url=url, metrics=metrics,
                             run=figures).start()  # fmt: skip
    try:
        yield reporter
    finally:
        reporter.stop()
