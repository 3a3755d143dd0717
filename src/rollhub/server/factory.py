"""The FastAPI application: builds the server's shared parts and puts the routers and middleware around them.

Request path, outermost first: request timing (every answer, the fast path's and refusals too), the API key,
gzip responses, the binary fast path (:mod:`rollhub.server.fastpath`), body reading with its limits and
memory budget, CORS, then the routers (:mod:`rollhub.server.routes`). Errors are answered by
:mod:`rollhub.server.errors` wherever they arise.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from rollhub.buffer import BufferConfig, ExperienceBuffer
from rollhub.server import errors, metrics, openapi
from rollhub.server.budget import RequestBudget
from rollhub.server.docs import install_docs
from rollhub.server.fastpath import BinaryIngest, FastPath
from rollhub.server.ingest import Ingest
from rollhub.server.middleware import AuthMiddleware, BodyLimits, BodyMiddleware, GzipResponseMiddleware
from rollhub.server.routes import Arrivals, Hub, atropos, extensions, observability
from rollhub.server.settings import ServerSettings
from rollhub.server.storage import make_group_storage
from rollhub.server.worker import StorageThread


class RollhubAPI(FastAPI):
    """FastAPI with the server's binary fast path (``fast_ingest``, for its figures)."""

    fast_ingest: BinaryIngest | None = None


def _hub(settings: ServerSettings, buffer: ExperienceBuffer | None) -> Hub:
    if buffer is None:
        config = BufferConfig(
            max_staleness=settings.max_staleness,
            max_queued_sequences=settings.max_queued_sequences,
            retry_after_s=settings.retry_after_s,
            stamp_unversioned=settings.stamp_unversioned,
        )
        buffer = ExperienceBuffer(make_group_storage(settings.storage), config)
    budget = RequestBudget(
        settings.max_request_memory_bytes, settings.body_idle_timeout_s, settings.body_timeout_s, settings.retry_after_s
    )
    thread, arrivals = StorageThread(inline=not buffer.storage.durable), Arrivals()  # memory never blocks
    ingest = Ingest(buffer, thread, settings.check_advantage_lengths, arrivals.notify)
    return Hub(buffer, settings, thread, ingest, arrivals, budget=budget)


def create_app(settings: ServerSettings | None = None, *, buffer: ExperienceBuffer | None = None) -> RollhubAPI:
    """Build the server around ``buffer`` (or one made from ``settings.storage``)."""
    settings = settings or ServerSettings()
    hub = _hub(settings, buffer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hub.arrivals.event = asyncio.Event()  # one of this event loop (an app may be served more than once)
        yield
        hub.thread.close()
        hub.buffer.storage.close()

    app = RollhubAPI(
        title="AtroposLib API",
        description="rollhub: an AtroposLib-compatible trajectory buffer with durable storage, binary bodies, "
        "long-poll, leases, staleness bounds and backpressure.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.buffer = hub.buffer
    app.state.settings = settings
    app.state.trim_heap = hub.trim_heap
    app.state.budget = hub.budget
    app.state.hub = hub
    errors.install(app)
    install_docs(app)
    openapi.install(app)
    for area in (atropos, extensions, observability):
        app.include_router(area.router(hub))
    _middleware(app, hub)
    return app


def flat_routes(routes: list[Any]) -> list[Any]:
    """``routes`` with every included router's routes in its place (FastAPI keeps included routers nested)."""
    out: list[Any] = []
    for route in routes:
        included = getattr(route, "original_router", None)
        out.extend(flat_routes(included.routes) if included is not None else [route])
    return out


def _middleware(app: RollhubAPI, hub: Hub) -> None:
    settings, routes = hub.settings, {r.path for r in flat_routes(app.routes) if hasattr(r, "path")}
    limits = BodyLimits(settings.max_body_bytes, hub.budget)
    app.fast_ingest = BinaryIngest(hub.ingest, limits)
    # added innermost first
    app.add_middleware(
        CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"], allow_headers=["*"]
    )
    app.add_middleware(BodyMiddleware, limits=limits)
    app.add_middleware(FastPath, fast=app.fast_ingest)
    app.add_middleware(GzipResponseMiddleware, minimum_size=1000, level=settings.gzip_level)
    if settings.api_key:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(metrics.TimingMiddleware, latency=hub.latency, routes=routes)  # outermost: times refusals too
