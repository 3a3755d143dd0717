"""What operators watch: ``/metrics`` (Prometheus text) and the live dashboard page with the data it polls."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, PlainTextResponse

from rollhub.server import dashboard as dashboard_page
from rollhub.server import metrics
from rollhub.server.routes import Hub


def router(hub: Hub) -> APIRouter:
    """The observability routes for ``hub.buffer`` and the server's request figures."""
    api = APIRouter()
    buf, run = hub.buffer, hub.thread.run

    @api.get(dashboard_page.PAGE_PATH, response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        """A live page of the queue and of every environment by name (no API key needed: it holds no data)."""
        return HTMLResponse(dashboard_page.PAGE)

    @api.get(dashboard_page.DATA_PATH)
    async def dashboard_data() -> dict[str, Any]:
        """What the dashboard polls: ``/status``, one row per environment, named as it registered, and the
        latest report of every rollout fleet (``fleets``)."""
        return {**await run(dashboard_page.snapshot, buf), "fleets": hub.fleets.to_json()}

    @api.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        buffer_part = await run(metrics.buffer_lines, buf)
        text = metrics.server_text([*buffer_part, *hub.fleets.lines()], hub.latency, hub.budget)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return api
