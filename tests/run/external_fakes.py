"""Fakes for trainer-only runs without vLLM: an engine that answers the weight-push routes, and an environment
that speaks the AtroposLib API the way ``BaseEnv`` does (register, then post scored groups, gzip and all)."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from tests.conftest import free_port


class FakeEngine:
    """vLLM's dev-mode weight routes, ``/health``, and a ``/metrics`` page whose running-requests gauge reads 1
    and 0 by turns; records every version pushed into it and counts the metrics reads."""

    def __init__(self) -> None:
        self.versions: list[str] = []
        self.calls: list[str] = []
        self.metrics_reads = 0

    def app(self) -> Starlette:
        async def ok(request: Request) -> JSONResponse:
            self.calls.append(request.url.path)
            if request.url.path == "/update_weight_version":
                self.versions.append(str((await request.json())["new_version"]))
            return JSONResponse({})

        async def info(request: Request) -> JSONResponse:
            return JSONResponse({"weight_version": self.versions[-1] if self.versions else "default"})

        async def metrics(request: Request) -> PlainTextResponse:
            self.metrics_reads += 1
            running = self.metrics_reads % 2
            return PlainTextResponse(f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0\n')

        paths = ("/health", "/pause", "/resume", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache")
        routes = [Route(p, ok, methods=["GET", "POST"]) for p in paths]
        return Starlette(routes=[*routes, Route("/weight_info", info), Route("/metrics", metrics)])


class Served:
    """An ASGI app served by uvicorn on a free loopback port, in a thread (stopped on exit)."""

    def __init__(self, app: Starlette) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the fake did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)


class AtroposLikeEnv(threading.Thread):
    """Waits for ``RUN_DIR/endpoints.json``, registers like ``BaseEnv`` and posts ``make_group(i)`` for i = 0, 1,
    ... (gzip JSON, ``env_id`` set, no ``policy_version``) until the server goes away or :meth:`stop` is called
    (a server that outlives the run).

    Args:
        run_dir: the run's directory.
        make_group: the ``ScoredData`` body of the i-th group (without ``env_id``).
        group_size: what it registers.
        max_queued: it waits while the server holds this many of its groups (BaseEnv's pause, simplified).
        hold_after: after posting this many groups it waits until :attr:`release` is set (``None``: never).
    """

    def __init__(self, run_dir: Path, make_group: Callable[[int], dict[str, Any]], group_size: int,
                 max_queued: int = 8, hold_after: int | None = None) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.hold_after = hold_after
        self.release = threading.Event()
        self.stopped = threading.Event()
        self.run_dir, self.make_group, self.group_size = run_dir, make_group, group_size
        self.max_queued = max_queued
        self.sent: list[dict[str, Any]] = []
        self.stamps: list[int | None] = []  # the policy_version the server gave each group it queued
        self.endpoints: dict[str, Any] | None = None
        self.error: BaseException | None = None

    def stop(self) -> None:
        """Post nothing more: the thread ends within one poll of the server."""
        self.stopped.set()
        self.release.set()

    def run(self) -> None:
        try:
            self._run()
        except httpx.TransportError:
            pass  # the run ended and took its server with it
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def _run(self) -> None:
        path = self.run_dir / "endpoints.json"
        while not path.exists():
            time.sleep(0.05)
        self.endpoints = json.loads(path.read_text())
        with httpx.Client(base_url=self.endpoints["server_url"], timeout=30) as http:
            registration = {"max_token_length": 64, "desired_name": "fake", "weight": 1.0, "group_size":
                            self.group_size, "min_batch_allocation": None}  # fmt: skip
            while (answer := http.post("/register-env", json=registration).json())["status"] != "success":
                time.sleep(0.1)
            env_id = answer["env_id"]
            for i in range(10**6):
                if i == self.hold_after:
                    self.release.wait()
                if self.stopped.is_set():
                    return
                status = http.request("GET", "/status-env", json={"env_id": env_id}).json()
                if status["queue_size"] >= self.max_queued:
                    self.stopped.wait(0.05)
                    continue
                body = {**self.make_group(i), "env_id": env_id}
                data = gzip.compress(json.dumps(body).encode())
                headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
                answer = http.post("/scored_data", content=data, headers=headers)
                assert answer.status_code == 200, answer.text
                self.sent.append(body)
                self.stamps.append(http.get("/latest_example").json().get("policy_version"))
