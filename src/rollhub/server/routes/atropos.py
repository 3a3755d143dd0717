"""AtroposLib 0.4.0's 13 routes, byte-compatible for JSON clients, with rollhub's additions on the same routes
(msgpack bodies and answers, long-poll and leases on ``GET /batch``, ``?env_id=`` on ``/status-env``)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse, Response

from rollhub.buffer import Batch
from rollhub.errors import Forbidden, InvalidInput, UnknownEnv
from rollhub.server import openapi, shapes
from rollhub.server.openapi import answers
from rollhub.server.routes import Hub
from rollhub.wire import codec
from rollhub.wire.group import group_to_item
from rollhub.wire.ingest import BodyInvalid
from rollhub.wire.models import EnvIdentifier, RegisterEnv, Registration, ScoredData

NUMPY = orjson.OPT_SERIALIZE_NUMPY
_NOT_REGISTERED = {"status": "error", "message": "Trainer not registered. Call /register first.", "batch": []}
_EMPTY_EXAMPLE = {
    k: []
    for k in (
        "tokens",
        "masks",
        "scores",
        "advantages",
        "ref_logprobs",
        "generation_params",
        "inference_logprobs",
        "messages",
        "images",
    )
}


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj, option=NUMPY), status_code=status, media_type="application/json")


def _decode_body(body: bytes, content_type: str) -> Any:
    """A small JSON or msgpack body (``/status-env``) as Python objects; 422 when it does not decode."""
    if content_type.startswith(codec.MEDIA_TYPE):
        return codec.unpackb(body)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        where = {"type": "json_invalid", "loc": ["body", exc.pos], "msg": "JSON decode error", "input": {}}
        raise BodyInvalid([{**where, "ctx": {"error": exc.msg}}]) from None


def _batch_response(batch: Batch | None, binary: bool, extras: bool) -> Response:
    if binary:
        payload: dict[str, Any] = {"batch": None, "batch_id": None, "step": None}
        if batch is not None:
            payload = {
                "batch": [codec.group_to_map(g) for g in batch.items],
                "batch_id": batch.batch_id,
                "step": batch.step,
            }
        return Response(codec.packb(payload), media_type=codec.MEDIA_TYPE)
    out: dict[str, Any] = {"batch": None if batch is None else [group_to_item(g) for g in batch.items]}
    if extras:
        out["batch_id"] = None if batch is None else batch.batch_id
        out["step"] = None if batch is None else batch.step
    return _json(out)


def router(hub: Hub) -> APIRouter:
    """The Atropos routes, serving ``hub.buffer``."""
    api = APIRouter()
    _run_routes(api, hub)
    _env_routes(api, hub)
    _data_routes(api, hub)
    _batch_route(api, hub)
    return api


def _run_routes(api: APIRouter, hub: Hub) -> None:
    """``/``, the trainer's registration and the run's figures, ``/reset_data``."""
    buf, run, settings = hub.buffer, hub.thread.run, hub.settings

    @api.get("/", response_model=None, responses=answers(openapi.RootAnswer))
    async def root() -> dict[str, str]:
        return {"message": "AtroposLib API"}

    @api.post("/register", response_model=None, responses=answers(openapi.RegisterAnswer))
    async def register(registration: Registration) -> dict[str, int]:
        return {"uuid": await run(buf.register_trainer, shapes.trainer_run(registration))}

    @api.get("/wandb_info", response_model=None, responses=answers(openapi.WandbInfo))
    async def wandb_info() -> dict[str, Any]:
        return shapes.wandb_info(buf.run)

    @api.get("/info", response_model=None, responses=answers(openapi.InfoAnswer))
    async def info() -> dict[str, Any]:
        return shapes.info(buf.run)

    @api.get("/status", response_model=None, responses=answers(openapi.StatusAnswer))
    async def status() -> dict[str, Any]:
        return shapes.status(await run(buf.status))

    @api.get(
        "/reset_data",
        response_class=PlainTextResponse,
        responses={
            200: {"description": "Reset successful", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **answers(None, {403: "/reset_data is switched off (the server was started with --no-reset)."}),
        },
    )
    async def reset_data() -> PlainTextResponse:
        if not settings.allow_reset:
            raise Forbidden("/reset_data is switched off on this server (started with --no-reset)")
        await run(buf.reset)
        return PlainTextResponse("Reset successful", status_code=200)


def _env_routes(api: APIRouter, hub: Hub) -> None:
    """The environments' registry: ``/register-env``, ``/disconnect-env``, ``/status-env``."""
    buf, run = hub.buffer, hub.thread.run

    @api.post("/register-env", response_model=None, responses=answers(openapi.RegisterEnvAnswer))
    async def register_env(register_env: RegisterEnv) -> dict[str, Any]:
        return shapes.register_env(await run(buf.register_env, shapes.env_request(register_env)))

    @api.post("/disconnect-env", response_model=None, responses=answers(openapi.DisconnectAnswer))
    async def disconnect_env(env: EnvIdentifier) -> dict[str, Any]:
        try:
            await run(buf.disconnect_env, env.env_id)
        except UnknownEnv:
            return shapes.disconnect_failed(env.env_id)
        return shapes.disconnected()

    @api.get(
        "/status-env",
        response_model=None,
        responses=answers(
            openapi.StatusEnvAnswer,
            {404: "env_id was never issued: call /register-env first.", 409: "", 422: ""},
        ),
        openapi_extra=openapi.body(EnvIdentifier, required=False, packed=EnvIdentifier, example={"env_id": 0}),
    )
    async def status_env(request: Request, env_id: int | None = Query(None, examples=[0])) -> dict[str, Any]:
        """Status for one env: ``?env_id=N`` or (as 0.4.0 clients send it) a JSON body ``{"env_id": N}``."""
        if env_id is None:
            body = await request.body()
            if not body:
                raise InvalidInput('env_id is missing: send ?env_id=N or a JSON body {"env_id": N}', field="env_id")
            obj = _decode_body(body, request.headers.get("content-type", ""))
            env_id = EnvIdentifier.model_validate(obj).env_id
        return shapes.status_env(await run(buf.status_env, env_id))


def _data_routes(api: APIRouter, hub: Hub) -> None:
    """Ingest (``/scored_data``, ``/scored_data_list``) and ``/latest_example``."""
    buf, run, ingest, trim_heap = hub.buffer, hub.thread.run, hub.ingest, hub.trim_heap

    async def ingest_request(request: Request, *, many: bool) -> dict[str, Any]:
        """Decode a ``/scored_data`` (one group) or ``/scored_data_list`` body, ingest it, wake long-polls."""
        body, ctype = await request.body(), request.headers.get("content-type", "")
        answer = await ingest(body, ctype, many=many)
        trim_heap()
        return answer

    @api.post(
        "/scored_data",
        response_model=None,
        responses=answers(openapi.ScoredDataAnswer, {429: ""}),
        openapi_extra=openapi.body(ScoredData),
    )
    async def scored_data(request: Request) -> Response:
        return _json(await ingest_request(request, many=False))

    @api.post(
        "/scored_data_list",
        response_model=None,
        responses=answers(openapi.ScoredDataListAnswer, {429: ""}),
        openapi_extra=openapi.body(ScoredData, many=True),
    )
    async def scored_data_list(request: Request) -> Response:
        return _json(await ingest_request(request, many=True))

    @api.get("/latest_example", response_model=None, responses=answers(openapi.LatestExample))
    async def latest_example() -> Response:
        latest = await run(buf.latest_example)
        return _json(_EMPTY_EXAMPLE if latest is None else group_to_item(latest))


def _batch_route(api: APIRouter, hub: Hub) -> None:
    """``GET /batch``: JSON or msgpack, long-poll (``wait_s``) and leases (``lease_s``)."""
    buf, run, settings = hub.buffer, hub.thread.run, hub.settings

    @api.get("/batch", response_model=None, responses=openapi.batch_answers())
    async def batch(
        request: Request,
        wait_s: float = Query(0.0, ge=0, description="Long-poll: wait up to this long for a batch."),
        lease_s: float | None = Query(None, gt=0, description="Lease the batch; unacked it is served again."),
    ) -> Response:
        if buf.run is None:
            return _json(_NOT_REGISTERED)
        await run(buf.mark_started)
        binary = codec.MEDIA_TYPE in request.headers.get("accept", "")
        extras = lease_s is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, settings.max_wait_s)
        while True:
            event = hub.arrivals.event
            # the batch leaves the queue only once its answer is encoded; a failure puts it back whole
            answer = await run(buf.serve_batch, lambda b: _batch_response(b, binary, extras), lease_s)
            if answer is not None:
                return answer
            remaining = deadline - loop.time()
            if remaining <= 0:
                return _batch_response(None, binary, extras)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=min(remaining, 0.5))
            if await request.is_disconnected():
                return Response(status_code=499)
