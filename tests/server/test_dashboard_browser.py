"""/dashboard drawn by headless Chromium, with every host but loopback unreachable, while data changes under it.

Runs where Debian's ``chromium`` is installed (``apt-get install chromium``) and is skipped elsewhere with that
reason. Two servers: a real ``rollhub serve --api-key`` with groups posted and batches pulled in a thread while the
page is open, and a small stand-in app whose ``/dashboard/data`` has every field the page can chart, so that every
chart is drawn. The key travels as ``#key=`` in the address (a fragment is never sent to a server). Screenshots at
1280x800 are written into the test's ``tmp_path``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from rollhub.server import dashboard
from rollhub.server.docs import STATIC_DIR
from tests.conftest import ServerProcess, free_port, registration_body
from tests.server.browser import needs_chromium, render_dom
from tests.server.test_fleet_route import figures, report

pytestmark = needs_chromium

KEY = "k-dash"
FLEET_CHARTS = ("chart-fleet-steps", "chart-fleet-restarts")
CHARTS = ("chart-ingest", "chart-serve", "chart-queue", "chart-staleness", "chart-age", "chart-shares", *FLEET_CHARTS)
TILES = ("tile-refused_429", "tile-stale_dropped_total", "tile-lease_expiries", "tile-serve_failures")
REG = registration_body(8, num_steps=100000)


def render(url: str, tmp_path: Path, name: str, screenshot: bool = True) -> dict[str, dict[str, str]]:
    """Attributes of every element with an id in the DOM of ``url`` after its scripts ran; ``name``.png is saved
    (unless not ``screenshot``: then the page is loaded once only)."""
    html = render_dom(url, tmp_path, name, window="1280,800", budget_ms=12000, screenshot=screenshot)
    (tmp_path / f"{name}.html").write_text(html)
    return Elements.read(html)


class Elements(HTMLParser):
    """Attributes by element id, plus whether each chart holds a canvas or svg and the text of the message line."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict[str, str]] = {}
        self.open: list[tuple[str, str | None]] = []

    @classmethod
    def read(cls, html: str) -> dict[str, dict[str, str]]:
        parser = cls()
        parser.feed(html)
        return parser.by_id

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        if "id" in found:
            self.by_id[found["id"]] = {**found, "drawn_with": "", "text": ""}
        if tag in ("canvas", "svg"):
            for _, owner in self.open:
                if owner in CHARTS:
                    self.by_id[owner]["drawn_with"] += tag + " "
        if tag not in ("input", "br", "link", "meta", "img", "hr"):
            self.open.append((tag, found.get("id")))

    def handle_endtag(self, tag: str) -> None:
        while self.open:
            if self.open.pop()[0] == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, owner in self.open:
            if owner in self.by_id:
                self.by_id[owner]["text"] += data


def points(el: dict[str, str]) -> int:
    return int(el.get("data-points") or 0)


def traffic(url: str, stop: threading.Event, served: threading.Event, errors: list[BaseException]) -> None:
    """Two environments posting groups tagged with the trainer's version (the batches it took so far) and a trainer
    pulling batches until ``stop``; ``served`` is set once two batches were taken."""
    try:
        with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
            assert c.post("/register", json=REG).status_code == 200
            c.get("/batch")
            for name, weight in (("gsm8k", 1.0), ("math", 3.0)):
                body = {"max_token_length": 64, "desired_name": name, "weight": weight, "group_size": 4}
                assert c.post("/register-env", json=body).status_code == 200
            i = taken = 0
            while not stop.is_set():
                steps = 64 * (i + 1)  # the fleet of a run posting its report, as rollhub run's reporter does
                workers = [figures("w0", steps), figures("w1", steps // 2, restarts=1, version=taken)]
                assert c.post("/fleet", json=report("live", time.time(), *workers)).status_code == 200
                for env_id in (0, 1, 1):
                    group = {
                        "tokens": [[1, i, k] for k in range(4)],
                        "masks": [[-100, i, k] for k in range(4)],
                        "scores": [1.0, 0.0, 1.0, 0.0],
                        "env_id": env_id,
                        "policy_version": taken,
                    }
                    c.post("/scored_data", json=group)
                    i += 1
                if i % 6 == 0 and c.get("/batch").json().get("batch") is not None:
                    taken += 1
                    if taken >= 2:
                        served.set()
                stop.wait(0.05)
    except BaseException as e:  # handed to the test, which fails with it
        errors.append(e)


def test_dashboard_charts_a_live_server_with_a_key(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory("--storage", "memory", "--api-key", KEY).start()
    stop, served, errors = threading.Event(), threading.Event(), []
    thread = threading.Thread(target=traffic, args=(server.url, stop, served, errors), daemon=True)
    thread.start()
    try:
        assert served.wait(120), errors or "no batch was served"
        page = render(f"{server.url}/dashboard#key={KEY}", tmp_path, "live")
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not errors, errors
    assert page["message"]["text"].strip() == "", page["message"]
    envs = page["envs"]["text"]
    assert "gsm8k" in envs and "math" in envs
    queue = page["chart-queue"]
    assert queue["data-state"] == "drawn" and "canvas" in queue["drawn_with"] and points(queue) >= 2, queue
    for chart in CHARTS:  # with batches served from versioned groups of two named environments, every chart draws
        assert page[chart].get("data-state") == "drawn", page[chart]
    # /status already counts stale drops and serve failures, so these two tiles have numbers today.
    assert page["tile-serve_failures"]["data-value"] == "0"
    assert page["tile-stale_dropped_total"]["data-value"] == "0"
    for chart in FLEET_CHARTS:  # the fleet's reports, posted while the page was open, are charted
        assert "canvas" in page[chart]["drawn_with"] and points(page[chart]) >= 2, page[chart]
    assert float(page["chart-fleet-steps"]["data-last"]) > 0, page["chart-fleet-steps"]
    assert "w1r1" in page["fleet"]["text"] and "live" in page["fleet"]["text"]
    assert (tmp_path / "live.png").stat().st_size > 10_000


# ------------------------------------------------------------------------------------------ every field the page reads
class FakeData:
    """Cumulative counters that grow by a fixed amount on every poll, in the shape ``/dashboard/data`` promises."""

    def __init__(self) -> None:
        self.polls = 0
        self.answers: int | None = None  # answer this many polls, then 503 (the page keeps what it drew)
        self.requests: list[tuple[str, str | None]] = []

    def __call__(self) -> dict[str, Any]:
        if self.answers is not None and self.polls >= self.answers:
            raise HTTPException(503, "gone")
        n = self.polls = self.polls + 1
        by_env = {"gsm8k": 8 * n, "math": 24 * n}
        return {
            "status": {
                "current_step": n,
                "queue_size": 10 + n % 5,
                "queued_sequences": 40 + 4 * (n % 5),
                "held_sequences": 0,
                "leased_batches": 1,
                "max_queued_sequences": 1000,
                "max_staleness": 4,
                "stale_dropped": {"0": n},
                "serve_failures": 0,
                "storage": {"quarantined": 0, "disk_full": False, "refused_full": 0},
            },
            "envs": [self.env(0, "gsm8k", 1.0, 0.2, by_env["gsm8k"]), self.env(1, "math", 3.0, None, by_env["math"])],
            "served": {"groups": 8 * n, "sequences": 32 * n, "by_env": by_env},
            "ingested": {"groups": 9 * n, "sequences": 36 * n, "by_env": {"gsm8k": 9 * n, "math": 27 * n}},
            "refused_429": 2 * n,
            "stale_dropped_total": n,
            "lease_expiries": 0,
            "serve_failures": 0,
            "staleness": {"le": [0, 1, 2, 3, 4, 6, 8, 16, 32], "counts": [20 * n, 8 * n, 3 * n, n, 0, 0, 0, 0, 0, 0]},
            "age_s": {"le": [0.1, 0.5, 1, 5, 30, 120], "counts": [5 * n, 10 * n, 9 * n, 6 * n, 2 * n, 0, 0]},
            "fleets": [self.fleet(n)],
        }

    @staticmethod
    def fleet(n: int) -> dict[str, Any]:
        """A fleet reporting every 2 s: w0 at 50 steps/s, w1 at 25 (restarted every third report)."""
        w0 = {**figures("w0", 100 * n), "mean_batch": 4.0}
        w1 = {**figures("w1", 50 * n, restarts=n // 3, version=None), "env_restarts": n, "mean_batch": 4.0}
        run = {
            "trained_groups": {"partial": 3, "whole": 1, "unknown": 4},
            "trained_samples": {"partial": 6, "whole": 10, "unknown": 16},
            "version_span": {"le": [0, 1, 2, 3, 4, 8], "counts": [1, 2, 0, 0, 0, 1, 0], "sum": 7.0},
            "trainer_wait_seconds": {"le": [1, 10], "counts": [1, 1, 0], "sum": 3.0},
            "trainer_stale_groups": 2,
            "engines": [{"engine": "0", "idle": 1, "busy": 3, "unanswered": 0, "idle_fraction": 0.25}],
            "partial_groups_ratio": 0.75,
            "partial_samples_ratio": 0.375,
        }
        return {
            **report("cartpole", 2.0 * n, w0, w1),
            "status_errors": 0,
            "post_errors": 0,
            "age_s": 0.5,
            "run": run,
        }

    @staticmethod
    def env(env_id: int, name: str, weight: float, min_alloc: float | None, served: int) -> dict[str, Any]:
        return {
            "env_id": env_id,
            "name": name,
            "wandb_name": f"{name}_0",
            "connected": True,
            "weight": weight,
            "group_size": 4,
            "queued_sequences": 20,
            "held_sequences": 0,
            "stale_dropped": 0,
            "min_batch_allocation": min_alloc,
            "served_sequences": served,
        }


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeData]]:
    """The real page and static files, with ``/dashboard/data`` answered by a ``FakeData`` behind the key."""
    data = FakeData()
    app = FastAPI()
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get(dashboard.PAGE_PATH, response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(dashboard.PAGE)

    @app.get(dashboard.DATA_PATH)
    async def snapshot(request: Request, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        data.requests.append((request.url.query, authorization))
        if authorization != f"Bearer {KEY}":
            raise HTTPException(401, "needs the key")
        return data()

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the stand-in server did not start"
        time.sleep(0.05)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
        yield f"http://127.0.0.1:{port}", data
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_dashboard_draws_every_chart_from_the_full_data(fake_server: tuple[str, FakeData], tmp_path: Path) -> None:
    url, data = fake_server
    page = render(f"{url}/dashboard#key={KEY}", tmp_path, "full")
    assert page["message"]["text"].strip() == "", page["message"]
    for chart in CHARTS:
        assert page[chart].get("data-state") == "drawn", page[chart]
        assert page[chart]["drawn_with"], chart
    for chart in ("chart-ingest", "chart-serve", "chart-queue"):
        assert "canvas" in page[chart]["drawn_with"] and points(page[chart]) >= 2, page[chart]
        assert float(page[chart]["data-last"]) > 0, page[chart]
    assert points(page["chart-staleness"]) == 10 and points(page["chart-age"]) == 7
    assert int(page["chart-staleness"]["data-total"]) > 0 and int(page["chart-age"]["data-total"]) > 0
    assert points(page["chart-shares"]) == 2 and "min allocation" in page["chart-shares"]["text"]
    assert "gsm8k" in page["chart-shares"]["text"] and "math" in page["chart-shares"]["text"]
    for chart in FLEET_CHARTS:
        assert "canvas" in page[chart]["drawn_with"] and points(page[chart]) >= 2, page[chart]
    assert float(page["chart-fleet-steps"]["data-last"]) == 75  # the total of 50 and 25 steps/s
    assert float(page["chart-fleet-restarts"]["data-last"]) >= 1  # w1 was restarted
    fleet_table = page["fleet"]["text"]
    assert "cartpole" in fleet_table and "none yet" in fleet_table and "4.00" in fleet_table
    runs = page["runs"]["text"]  # the run's own figures: versions of what it trained on, waits, drops, idle engines
    for shown in ("3 / 1 / 4", "75.0%", "37.5%", "\u22640: 1, \u22641: 2, \u22648: 1", "1.50 (2)", "engine 0: 25.0%"):
        assert shown in runs, (shown, runs)
    assert int(page["tile-refused_429"]["data-value"]) >= 2
    assert all(page[t]["data-value"] != "" for t in TILES)
    # The key went only as a Bearer header, never in the address.
    assert data.requests and all(auth == f"Bearer {KEY}" and not query for query, auth in data.requests)
    assert (tmp_path / "full.png").stat().st_size > 10_000
    # storage's figures read one row each; no cell of the page reads [object Object]
    assert "storage.quarantined0" in page["status"]["text"] and "storage.disk_fullfalse" in page["status"]["text"]
    assert "[object Object]" not in (tmp_path / "full.html").read_text()


def test_the_first_poll_draws_a_time_axis_around_now(fake_server: tuple[str, FakeData], tmp_path: Path) -> None:
    url, data = fake_server
    data.answers = 1  # the page draws from its first poll only
    before = time.time()
    page = render(f"{url}/dashboard#key={KEY}", tmp_path, "first", screenshot=False)
    assert data.polls == 1 and "503" in page["message"]["text"]
    for chart in ("chart-queue", "chart-fleet-steps", "chart-fleet-restarts"):  # time series with one poll
        el = page[chart]
        assert el["data-state"] == "drawn" and points(el) in (0, 1) and "canvas" in el["drawn_with"], el
        low, high = float(el["data-x-min"]), float(el["data-x-max"])
        assert abs(high - before) < 86_400 and abs(low - before) < 86_400, (chart, low, high, before)
        assert 0 < high - low <= 3600, (chart, low, high)
    assert points(page["chart-queue"]) == 1
    assert "[object Object]" not in (tmp_path / "first.html").read_text()
