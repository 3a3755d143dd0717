"""The gateway over HTTP: OpenAI-compatible routes per session, and the routes that open and end sessions.

==========================================  =========================================================================
``POST /sessions``                          open a session: ``{group, group_size, max_tokens, metadata}`` (all
                                            optional) -> ``{session_id, base_url, engine, max_tokens}``
``POST /sessions/{id}/v1/chat/completions`` an OpenAI chat call (``n = 1``, no streaming, no ``stop``)
``POST /sessions/{id}/v1/completions``      an OpenAI completions call (``prompt``: text or token ids)
``GET  /sessions/{id}/v1/models``           the served model (also ``GET /v1/models``)
``POST /sessions/{id}/reward``              ``{reward, correct, turn_rewards}`` before the end
``POST /sessions/{id}/finish``              end the episode (``{reward, correct, turn_rewards}``, all optional)
``DELETE /sessions/{id}``                   abandon it (the partial-episode rule of :mod:`rollhub.gateway.core`)
``GET  /sessions/{id}``                     its state, turns, rows, tokens, budget
``POST /policy-version``                    ``{policy_version}``: the version now loaded in the engines
``GET  /status``                            counts and open sessions per engine
==========================================  =========================================================================

Errors are OpenAI-shaped (``{"error": {"message", "type", "code"}}``), mapped in one place: an unknown session 404,
an ended one 409, a call while another of the session runs 409, a prompt past the episode's budget 400
(``code: "episode_budget_exceeded"``), a model not served 404 (``model_not_found``), a malformed request 400, an
engine failure 502, a group the sink could not take 503. Calls run in worker threads, so an agent that disconnects
does not stop its call: the turn is recorded when the engine answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from rollhub.envs.episode.render import RenderError
from rollhub.envs.episode.tokens import TokenDriftError
from rollhub.errors import RollhubError
from rollhub.gateway.core import Gateway
from rollhub.gateway.session import (
    BadRequest,
    BudgetExceeded,
    EngineFailed,
    SessionBusy,
    SessionClosed,
    SinkFailed,
    UnknownModel,
    UnknownSession,
)

STATUS: dict[type[RollhubError], tuple[int, str]] = {
    UnknownSession: (404, "session_not_found"),
    SessionClosed: (409, "session_closed"),
    SessionBusy: (409, "session_busy"),
    BudgetExceeded: (400, "episode_budget_exceeded"),
    UnknownModel: (404, "model_not_found"),
    BadRequest: (400, "invalid_request"),
    RenderError: (400, "chat_template_failed"),
    EngineFailed: (502, "engine_failed"),
    TokenDriftError: (502, "engine_changed_prompt"),
    SinkFailed: (503, "sink_failed"),
}


class _Open(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group: str | None = None
    group_size: int = 1
    max_tokens: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class _Chat(BaseModel):
    model_config = ConfigDict(extra="allow")  # temperature and the like are accepted and ignored
    model: str | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None


class _Completion(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None


class _Reward(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float | None = None
    correct: bool = False
    turn_rewards: list[float] | None = None


class _Version(BaseModel):
    policy_version: int = Field(ge=0)


def _error(status: int, code: str, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status)


def _supported(body: _Chat | _Completion) -> None:
    if body.n != 1:
        raise BadRequest(f"n={body.n}: a session is one episode, so each call samples one choice; send n=1")
    if body.stream:
        raise BadRequest("streaming is not supported; send stream=false")
    if body.stop:
        raise BadRequest("stop strings are not supported (the engine would cut its sampled ids); leave stop out")


def create_gateway_app(gateway: Gateway, reap_every_s: float | None = None) -> FastAPI:
    """The FastAPI app serving ``gateway`` (see the module docstring); idle sessions are reaped every
    ``reap_every_s`` seconds (default: a quarter of the idle timeout, at most 5 s)."""
    every = reap_every_s or min(5.0, gateway.config.idle_timeout_s / 4)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def reaper() -> None:
            while True:
                await asyncio.sleep(every)
                await asyncio.to_thread(gateway.reap)

        task = asyncio.create_task(reaper())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="rollhub gateway", lifespan=lifespan)
    app.state.gateway = gateway

    @app.exception_handler(RollhubError)
    async def rollhub_error(_: Request, exc: RollhubError) -> JSONResponse:
        status, code = next((STATUS[k] for k in type(exc).__mro__ if k in STATUS), (500, "internal_error"))
        return _error(status, code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error(400, "invalid_request", f"{where}: {first.get('msg', 'invalid request')}")

    @app.get("/")
    def root() -> dict[str, Any]:
        return {"message": "rollhub gateway", "model": gateway.config.model}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/status")
    def status() -> dict[str, Any]:
        return gateway.status()

    @app.post("/policy-version")
    def policy_version(body: _Version) -> dict[str, Any]:
        gateway.policy_version = body.policy_version
        return {"policy_version": body.policy_version}

    @app.get("/v1/models")
    @app.get("/sessions/{session_id}/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": gateway.config.model, "object": "model", "owned_by": "rollhub"}]}

    @app.post("/sessions")
    def open_session(body: _Open, request: Request) -> dict[str, Any]:
        session = gateway.open(body.group, body.group_size, body.max_tokens, body.metadata)
        base = str(request.base_url).rstrip("/")
        return {"session_id": session.id, "base_url": f"{base}/sessions/{session.id}/v1", "engine": session.engine,
                "group": session.group, "max_tokens": session.max_tokens}  # fmt: skip

    @app.get("/sessions/{session_id}")
    def session_info(session_id: str) -> dict[str, Any]:
        return gateway.session(session_id, open_only=False).info()

    @app.delete("/sessions/{session_id}")
    def abandon(session_id: str) -> dict[str, Any]:
        return gateway.abandon(session_id)

    @app.post("/sessions/{session_id}/reward")
    def reward(session_id: str, body: _Reward) -> dict[str, Any]:
        if body.reward is None:
            raise BadRequest("reward is required here (finish takes an optional one)")
        gateway.post_reward(session_id, body.reward, body.correct, body.turn_rewards)
        return gateway.session(session_id).info()

    @app.post("/sessions/{session_id}/finish")
    def finish(session_id: str, body: _Reward | None = None) -> dict[str, Any]:
        body = body or _Reward()
        return gateway.finish(session_id, body.reward, body.correct, body.turn_rewards)

    @app.post("/sessions/{session_id}/v1/chat/completions")
    def chat(session_id: str, body: _Chat) -> dict[str, Any]:
        _supported(body)
        cap = body.max_completion_tokens or body.max_tokens
        return gateway.chat(session_id, body.messages, body.tools, body.model, cap)

    @app.post("/sessions/{session_id}/v1/completions")
    def complete(session_id: str, body: _Completion) -> dict[str, Any]:
        _supported(body)
        return gateway.complete(session_id, body.prompt, body.model, body.max_tokens)

    return app
