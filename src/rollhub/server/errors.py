"""The one place where errors become HTTP answers; no client mistake answers 500."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollhub.errors import InvalidInput, QueueFull, RollhubError, StorageFull

log = logging.getLogger("rollhub.server")


class JSONResponse(Response):
    """JSON via orjson: never fails on values a client sent (non-finite floats become null)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        try:
            return orjson.dumps(content, default=str, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError:  # an integer past 64 bits echoed back from the request
            return orjson.dumps(_plain(content), default=str)


def _plain(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class Unprocessable(Exception):
    """A request body that failed validation, with FastAPI-style ``detail`` entries (answered 422)."""

    def __init__(self, detail: list[dict[str, Any]]) -> None:
        super().__init__(detail)
        self.detail = detail


def pydantic_detail(exc: ValidationError, prefix: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """pydantic errors worded exactly as FastAPI words them for a body model."""
    out = []
    for err in exc.errors(include_url=False):
        entry = {"type": err["type"], "loc": ["body", *prefix, *err["loc"]], "msg": err["msg"]}
        entry["input"] = err.get("input")
        if "ctx" in err:
            entry["ctx"] = {k: str(v) if isinstance(v, Exception) else v for k, v in err["ctx"].items()}
        out.append(entry)
    return jsonable_encoder(out)


def not_utf8_detail(exc: UnicodeDecodeError) -> list[dict[str, Any]]:
    """A body that is not UTF-8, worded as FastAPI words any other undecodable JSON body (``json_invalid``)."""
    return [
        {
            "type": "json_invalid",
            "loc": ["body", exc.start],
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": f"byte {exc.start} is not UTF-8; send the body as UTF-8 JSON"},
        }
    ]


def invalid_detail(exc: InvalidInput, prefix: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    detail = exc.detail()
    for entry in detail:
        entry["loc"] = ["body", *prefix, *entry["loc"][1:]]
    return detail


def _retry_after(exc: RollhubError) -> dict[str, str]:
    if isinstance(exc, QueueFull | StorageFull):
        return {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    return {}


def rollhub_error_response(exc: RollhubError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The answer to ``exc`` as (status, extra headers, JSON body), for pure-ASGI routes."""
    headers = [(k.lower().encode(), v.encode()) for k, v in _retry_after(exc).items()]
    return exc.status_code, headers, JSONResponse({"detail": exc.detail()}).body


def install(app: FastAPI) -> None:
    """Register the exception handlers on ``app``."""

    @app.exception_handler(RollhubError)
    async def _rollhub(request: Request, exc: RollhubError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail()}, status_code=exc.status_code, headers=_retry_after(exc))

    @app.exception_handler(Unprocessable)
    async def _unprocessable(request: Request, exc: Unprocessable) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=422)

    @app.exception_handler(ValidationError)
    async def _pydantic(request: Request, exc: ValidationError) -> JSONResponse:
        return JSONResponse({"detail": pydantic_detail(exc)}, status_code=422)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": jsonable_encoder(exc.errors())}, status_code=422)

    @app.exception_handler(UnicodeDecodeError)
    async def _not_utf8(request: Request, exc: UnicodeDecodeError) -> JSONResponse:
        return JSONResponse({"detail": not_utf8_detail(exc)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI answers 400 "There was an error parsing the body" when a JSON body is not UTF-8; every
        # other route (and /scored_data) answers such a body with 422 json_invalid, so these do too.
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
            return JSONResponse({"detail": not_utf8_detail(cause)}, status_code=422)
        return await http_exception_handler(request, exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"detail": f"internal error ({type(exc).__name__}); this is a server bug, please report it"},
            status_code=500,
        )
