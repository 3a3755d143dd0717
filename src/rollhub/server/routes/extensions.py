"""rollhub's own routes beside the Atropos ones: ``/health``, ``/ack`` (confirming a leased batch),
``/policy-version`` (the trainer publishing its policy version) and ``/fleet`` (a rollout fleet's figures)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from rollhub.observe.fleet_report import FleetReport
from rollhub.server import openapi, shapes
from rollhub.server.openapi import answers
from rollhub.server.routes import Hub


class AckRequest(BaseModel):
    """``POST /ack``: confirm a leased batch."""

    batch_id: str


def router(hub: Hub) -> APIRouter:
    """The extension routes, serving ``hub.buffer``."""
    api = APIRouter()
    buf, run = hub.buffer, hub.thread.run

    @api.get("/health", response_model=None, responses=answers(openapi.HealthAnswer))
    async def health() -> dict[str, Any]:
        # answered on the event loop without the buffer's lock: it stays live while storage is slow
        return {"status": "ok", "storage": buf.storage.url, "durable": buf.storage.durable, "step": buf.step}

    @api.post(
        "/ack",
        response_model=None,
        responses=answers(openapi.AckAnswer, {404: "batch_id is not leased (never issued, acknowledged or expired)."}),
    )
    async def ack(body: AckRequest) -> dict[str, str]:
        await run(buf.ack, body.batch_id)
        return {"status": "acknowledged"}

    @api.post(
        "/policy-version",
        response_model=None,
        responses=answers(openapi.PolicyVersionAnswer, {409: "policy_version is lower than the one published."}),
    )
    async def policy_version(body: shapes.PolicyVersionRequest) -> dict[str, int]:
        """The trainer publishes its policy version; the staleness bound compares against it from now on."""
        return shapes.version_published(await run(buf.publish_version, body.policy_version))

    @api.post("/fleet", response_model=None, responses=answers(openapi.FleetAnswer))
    async def fleet(body: FleetReport) -> dict[str, Any]:
        """A rollout fleet's figures (``rollhub run`` posts them every few seconds): kept as the fleet's latest
        report for ``/metrics`` (``rollhub_fleet_*``) and the dashboard; a body that does not validate is
        answered 422 naming the field, and nothing is kept."""
        hub.fleets.put(body)
        return {"status": "received", "fleet": body.fleet, "workers": len(body.workers)}

    return api
