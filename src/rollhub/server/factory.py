"""The FastAPI application: AtroposLib 0.4.0's 13 routes, byte-compatible for JSON clients, plus extensions
(msgpack bodies, long-poll, leases and ``/ack``, ``?env_id=`` on ``/status-env``, ``/health``, ``/metrics``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from rollhub.buffer import Batch, BufferConfig, ExperienceBuffer, Ingested, make_storage
from rollhub.errors import Forbidden, InvalidInput, UnknownEnv
from rollhub.experience.group import Group
from rollhub.server import dashboard as dashboard_page
from rollhub.server import errors, metrics, openapi, shapes
from rollhub.server.budget import RequestBudget
from rollhub.server.docs import install_docs
from rollhub.server.fastpath import BinaryIngest
from rollhub.server.heap import HeapTrimmer
from rollhub.server.middleware import AuthMiddleware, BodyMiddleware, GzipResponseMiddleware
from rollhub.server.openapi import answers
from rollhub.server.settings import ServerSettings
from rollhub.wire import codec
from rollhub.wire.fastjson import parse_groups
from rollhub.wire.group import group_from_json
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


class AckRequest(BaseModel):
    """``POST /ack``: confirm a leased batch."""

    batch_id: str


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj, option=NUMPY), status_code=status, media_type="application/json")


class _Arrivals:
    """Wakes long-polling ``GET /batch`` requests when data arrives."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def notify(self) -> None:
        self.event.set()
        self.event = asyncio.Event()


def _decode_body(body: bytes, content_type: str) -> tuple[Any, bool]:
    if not body:
        raise errors.Unprocessable([{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}])
    if content_type.startswith(codec.MEDIA_TYPE):
        return codec.unpackb(body), True
    try:
        return orjson.loads(body), False
    except orjson.JSONDecodeError as exc:
        raise errors.Unprocessable(
            [
                {
                    "type": "json_invalid",
                    "loc": ["body", exc.pos],
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": exc.msg},
                }
            ]
        ) from None


def _to_group(obj: Any, binary: bool, strict: bool, prefix: tuple[Any, ...] = ()) -> Group:
    try:
        if binary:
            return codec.group_from_map(obj, check_advantage_lengths=strict)
        return group_from_json(obj, check_advantage_lengths=strict)
    except ValidationError as exc:
        raise errors.Unprocessable(errors.pydantic_detail(exc, prefix)) from None
    except InvalidInput as exc:
        raise errors.Unprocessable(errors.invalid_detail(exc, prefix)) from None


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
    out: dict[str, Any] = {"batch": None if batch is None else [g.to_item() for g in batch.items]}
    if extras:
        out["batch_id"] = None if batch is None else batch.batch_id
        out["step"] = None if batch is None else batch.step
    return _json(out)


class RollhubAPI(FastAPI):
    """FastAPI with :class:`rollhub.server.fastpath.BinaryIngest` in front of the whole middleware stack."""

    fast_ingest: BinaryIngest | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        fast = self.fast_ingest
        length = fast.body_length(scope) if fast is not None else None
        if length is not None:
            return await fast(scope, receive, send, super().__call__, length)  # type: ignore[misc]
        await super().__call__(scope, receive, send)


def create_app(settings: ServerSettings | None = None, *, buffer: ExperienceBuffer | None = None) -> RollhubAPI:
    """Build the server around ``buffer`` (or one made from ``settings.storage``)."""
    settings = settings or ServerSettings()
    if buffer is None:
        config = BufferConfig(
            max_staleness=settings.max_staleness,
            max_queued_sequences=settings.max_queued_sequences,
            retry_after_s=settings.retry_after_s,
        )
        buffer = ExperienceBuffer(make_storage(settings.storage), config)
    buf = buffer
    strict = settings.check_advantage_lengths
    latency = metrics.LatencyHistograms()
    budget = RequestBudget(
        settings.max_request_memory_bytes, settings.body_idle_timeout_s, settings.body_timeout_s, settings.retry_after_s
    )
    trim_heap = HeapTrimmer()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.arrivals = _Arrivals()
        yield
        buf.storage.close()

    app = RollhubAPI(
        title="AtroposLib API",
        description="rollhub: an AtroposLib-compatible trajectory buffer with durable storage, binary bodies, "
        "long-poll, leases, staleness bounds and backpressure.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.buffer = buf
    app.state.settings = settings
    app.state.trim_heap = trim_heap
    app.state.budget = budget
    app.state.arrivals = _Arrivals()
    errors.install(app)
    install_docs(app)
    openapi.install(app)

    def arrived() -> None:
        app.state.arrivals.notify()

    @app.get("/", response_model=None, responses=answers(openapi.RootAnswer))
    async def root() -> dict[str, str]:
        return {"message": "AtroposLib API"}

    @app.get("/health", response_model=None, responses=answers(openapi.HealthAnswer))
    async def health() -> dict[str, Any]:
        return {"status": "ok", "storage": buf.storage.url, "durable": buf.storage.durable, "step": buf.step}

    @app.get(dashboard_page.PAGE_PATH, response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        """A live page of the queue and of every environment by name (no API key needed: it holds no data)."""
        return HTMLResponse(dashboard_page.PAGE)

    @app.get(dashboard_page.DATA_PATH)
    async def dashboard_data() -> dict[str, Any]:
        """What the dashboard polls: ``/status`` and one row per environment, named as it registered."""
        return dashboard_page.snapshot(buf)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(buf, latency, budget), media_type="text/plain; version=0.0.4")

    @app.post("/register", response_model=None, responses=answers(openapi.RegisterAnswer))
    async def register(registration: Registration) -> dict[str, int]:
        return {"uuid": buf.register_trainer(shapes.trainer_run(registration))}

    @app.get("/wandb_info", response_model=None, responses=answers(openapi.WandbInfo))
    async def wandb_info() -> dict[str, Any]:
        return shapes.wandb_info(buf.run)

    @app.get("/info", response_model=None, responses=answers(openapi.InfoAnswer))
    async def info() -> dict[str, Any]:
        return shapes.info(buf.run)

    @app.get("/status", response_model=None, responses=answers(openapi.StatusAnswer))
    async def status() -> dict[str, Any]:
        return shapes.status(buf.status())

    @app.post(
        "/policy-version",
        response_model=None,
        responses=answers(openapi.PolicyVersionAnswer, {409: "policy_version is lower than the one published."}),
    )
    async def policy_version(body: shapes.PolicyVersionRequest) -> dict[str, int]:
        """The trainer publishes its policy version; the staleness bound compares against it from now on."""
        return shapes.version_published(buf.publish_version(body.policy_version))

    @app.post("/register-env", response_model=None, responses=answers(openapi.RegisterEnvAnswer))
    async def register_env(register_env: RegisterEnv) -> dict[str, Any]:
        return shapes.register_env(buf.register_env(register_env))

    @app.post("/disconnect-env", response_model=None, responses=answers(openapi.DisconnectAnswer))
    async def disconnect_env(env: EnvIdentifier) -> dict[str, Any]:
        try:
            buf.disconnect_env(env.env_id)
        except UnknownEnv:
            return shapes.disconnect_failed(env.env_id)
        return shapes.disconnected()

    @app.get(
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
            obj, _ = _decode_body(body, request.headers.get("content-type", ""))
            env_id = EnvIdentifier.model_validate(obj).env_id
        return shapes.status_env(buf.status_env(env_id))

    async def ingest_request(request: Request, *, many: bool) -> list[Ingested]:
        """Decode a ``/scored_data`` (one group) or ``/scored_data_list`` body, ingest it, wake long-polls."""
        body, ctype = await request.body(), request.headers.get("content-type", "")
        groups = (
            None
            if ctype.startswith(codec.MEDIA_TYPE)
            else parse_groups(body, many=many, check_advantage_lengths=strict)
        )
        if groups is None:
            obj, binary = _decode_body(body, ctype)
            if not many:
                groups = [_to_group(obj, binary, strict)]
            elif isinstance(obj, list):
                groups = [_to_group(item, binary, strict, (i,)) for i, item in enumerate(obj)]
            else:
                raise errors.Unprocessable(
                    [{"type": "list_type", "loc": ["body"], "msg": "Input should be a valid list", "input": None}]
                )
        results = buf.ingest(groups)
        arrived()
        trim_heap()
        return results

    @app.post(
        "/scored_data",
        response_model=None,
        responses=answers(openapi.ScoredDataAnswer, {429: ""}),
        openapi_extra=openapi.body(ScoredData),
    )
    async def scored_data(request: Request) -> Response:
        return _json(shapes.scored_data((await ingest_request(request, many=False))[0]))

    @app.post(
        "/scored_data_list",
        response_model=None,
        responses=answers(openapi.ScoredDataListAnswer, {429: ""}),
        openapi_extra=openapi.body(ScoredData, many=True),
    )
    async def scored_data_list(request: Request) -> Response:
        return _json(shapes.scored_data_list(await ingest_request(request, many=True)))

    @app.get("/batch", response_model=None, responses=openapi.batch_answers())
    async def batch(
        request: Request,
        wait_s: float = Query(0.0, ge=0, description="Long-poll: wait up to this long for a batch."),
        lease_s: float | None = Query(None, gt=0, description="Lease the batch; unacked it is served again."),
    ) -> Response:
        if buf.run is None:
            return _json(_NOT_REGISTERED)
        buf.mark_started()
        binary = codec.MEDIA_TYPE in request.headers.get("accept", "")
        extras = lease_s is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, settings.max_wait_s)
        while True:
            event = app.state.arrivals.event
            # the batch leaves the queue only once its answer is encoded; a failure puts it back whole
            answer = buf.serve_batch(lambda b: _batch_response(b, binary, extras), lease_s)
            if answer is not None:
                return answer
            remaining = deadline - loop.time()
            if remaining <= 0:
                return _batch_response(None, binary, extras)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=min(remaining, 0.5))
            if await request.is_disconnected():
                return Response(status_code=499)

    @app.post(
        "/ack",
        response_model=None,
        responses=answers(openapi.AckAnswer, {404: "batch_id is not leased (never issued, acknowledged or expired)."}),
    )
    async def ack(body: AckRequest) -> dict[str, str]:
        buf.ack(body.batch_id)
        return {"status": "acknowledged"}

    @app.get("/latest_example", response_model=None, responses=answers(openapi.LatestExample))
    async def latest_example() -> Response:
        latest = buf.latest_example()
        return _json(_EMPTY_EXAMPLE if latest is None else latest.to_item())

    @app.get(
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
        buf.reset()
        return PlainTextResponse("Reset successful", status_code=200)

    routes = {r.path for r in app.routes}
    app.fast_ingest = BinaryIngest(buf, settings, latency, _to_group, shapes.scored_data_list, arrived, budget)
    app.add_middleware(
        CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"], allow_headers=["*"]
    )
    app.add_middleware(GzipResponseMiddleware, minimum_size=1000, level=settings.gzip_level)
    app.add_middleware(BodyMiddleware, max_bytes=settings.max_body_bytes, budget=budget)
    if settings.api_key:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(metrics.TimingMiddleware, latency=latency, routes=routes)  # outermost: times refusals too
    return app
