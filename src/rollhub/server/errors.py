"""The one place where errors become HTTP answers: the status table and the rendering every route and the
binary fast path share; no client mistake answers 500."""

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

from rollhub.errors import (
    ConfigError,
    Forbidden,
    InvalidInput,
    NotRegistered,
    PayloadTooLarge,
    QueueFull,
    RollhubError,
    StorageError,
    StorageFull,
    Unauthorized,
    UnknownBatch,
    UnknownEnv,
    VersionConflict,
)
from rollhub.wire.ingest import pydantic_entries

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


STATUS: dict[type[RollhubError], int] = {
    InvalidInput: 422,
    PayloadTooLarge: 413,
    NotRegistered: 409,
    VersionConflict: 409,
    UnknownEnv: 404,
    UnknownBatch: 404,
    QueueFull: 429,
    Forbidden: 403,
    Unauthorized: 401,
    StorageError: 503,
    ConfigError: 400,
    RollhubError: 400,
}
"""The HTTP status of each error class; a subclass answers as its nearest listed ancestor."""


def http_status(exc: RollhubError) -> int:
    """The status ``exc`` is answered with (from :data:`STATUS`)."""
    for cls in type(exc).__mro__:
        status = STATUS.get(cls)
        if status is not None:
            return status
    return 400


def pydantic_detail(exc: ValidationError, prefix: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """pydantic errors worded exactly as FastAPI words them for a body model."""
    return jsonable_encoder(pydantic_entries(exc, prefix))


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


def _retry_after(exc: RollhubError) -> list[tuple[bytes, bytes]]:
    if isinstance(exc, QueueFull | StorageFull):
        return [(b"retry-after", str(max(1, round(exc.retry_after_s))).encode())]
    return []


def render(exc: BaseException, where: str = "") -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The answer to ``exc`` as (status, extra headers, JSON body): the one rendering of errors, used by the
    exception handlers of the routes and by the pure-ASGI binary fast path.

    Args:
        exc: what a request raised.
        where: the request (``"POST /scored_data"``), for the log of an unexpected error.
    """
    if isinstance(exc, RollhubError):
        status, headers, detail = http_status(exc), _retry_after(exc), jsonable_encoder(exc.detail())
    elif isinstance(exc, ValidationError):
        status, headers, detail = 422, [], pydantic_detail(exc)
    elif isinstance(exc, RequestValidationError):
        status, headers, detail = 422, [], jsonable_encoder(exc.errors())
    elif isinstance(exc, UnicodeDecodeError):
        status, headers, detail = 422, [], not_utf8_detail(exc)
    else:
        log.error("unexpected error on %s", where, exc_info=exc)
        status, headers = 500, []
        detail = f"internal error ({type(exc).__name__}); this is a server bug, please report it"
    return status, headers, JSONResponse({"detail": detail}).body


def _response(exc: BaseException, request: Request) -> Response:
    status, headers, body = render(exc, f"{request.method} {request.url.path}")
    response = Response(body, status_code=status, media_type="application/json")
    response.raw_headers.extend(headers)
    return response


def install(app: FastAPI) -> None:
    """Register the exception handlers on ``app``."""

    for kind in (RollhubError, ValidationError, RequestValidationError, UnicodeDecodeError, Exception):
        app.add_exception_handler(kind, _handler)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI answers 400 "There was an error parsing the body" when a JSON body is not UTF-8; every
        # other route (and /scored_data) answers such a body with 422 json_invalid, so these do too.
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
            return _response(cause, request)
        return await http_exception_handler(request, exc)


async def _handler(request: Request, exc: Exception) -> Response:
    return _response(exc, request)
