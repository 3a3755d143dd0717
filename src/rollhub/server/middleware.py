"""Pure-ASGI middleware: API-key check, body size limit with gzip request bodies, gzip responses.

They run before routing, so their answers are plain HTTP errors with a message that says what to do.
"""

from __future__ import annotations

import gzip
import hmac
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The dashboard page holds no data (its script sends the key for the data it polls); open so its key box loads.
OPEN_PATHS = frozenset({"/", "/health", "/dashboard"})
# The documentation pages, their packaged assets and the schema they render carry no buffer data.
DOC_PATHS = frozenset({"/docs", "/redoc", "/openapi.json"})
STATIC_PREFIX = "/static/"
_COMPRESSIBLE = (b"application/json", b"text/")  # raw array buffers gain little from gzip


async def _error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = orjson.dumps({"detail": message})
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path in DOC_PATHS or path.startswith(STATIC_PREFIX)


class AuthMiddleware:
    """Refuse (401) any request without ``Authorization: Bearer <api_key>``, except ``OPEN_PATHS`` (``/``,
    ``/health`` and the ``/dashboard`` page), the API documentation (``/docs``, ``/redoc``, ``/openapi.json``,
    ``/static/...``) and CORS preflights."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or _is_open(path):
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization") or b""
        if not hmac.compare_digest(given, self.expected):
            what = "missing" if not given else "wrong"
            return await _error(
                send,
                401,
                f"API key {what}: send the header 'Authorization: Bearer <key>' with the server's --api-key",
                [(b"www-authenticate", b"Bearer")],
            )
        return await self.app(scope, receive, send)


class BodyMiddleware:
    """Read the whole request body once: enforce ``max_bytes`` (413) and inflate ``Content-Encoding: gzip``
    (400 when the gzip is corrupt), so routes always see the plain body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (
            scope.get("method") in ("GET", "HEAD", "OPTIONS") and not _header(scope, b"content-length")
        ):
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _error(send, 413, f"request body of {int(declared)} bytes is over the limit of {limit}")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _error(send, 413, f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        encoding = (_header(scope, b"content-encoding") or b"").lower()
        if b"gzip" in encoding and body:
            try:
                inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
                body = inflater.decompress(body, limit + 1)
                if len(body) > limit or inflater.unconsumed_tail:
                    return await _error(send, 413, f"decompressed request body is over the limit of {limit} bytes")
                if not inflater.eof:
                    raise zlib.error("truncated gzip stream")
            except zlib.error as exc:
                return await _error(send, 400, f"Invalid gzip payload: {exc}; send valid gzip or drop the header")
        if b"gzip" in encoding:
            scope = dict(scope)
            scope["headers"] = [
                (k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")
            ] + [(b"content-length", str(len(body)).encode())]
        return await self.app(scope, replay_body(body, receive), send)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands out ``body`` (already read) as one message, then defers to ``receive``."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class GzipResponseMiddleware:
    """Gzip responses of at least ``minimum_size`` bytes when the client accepts gzip (as 0.4.0 does)."""

    def __init__(self, app: ASGIApp, minimum_size: int = 1000, level: int = 1) -> None:
        self.app = app
        self.minimum_size = minimum_size
        self.level = level

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or b"gzip" not in (_header(scope, b"accept-encoding") or b"").lower():
            return await self.app(scope, receive, send)
        start: Message | None = None
        parts: list[bytes] = []

        async def wrapped(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                return await send(message)
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(parts)
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            ctype = next((v for k, v in headers if k == b"content-type"), b"")
            already = any(k == b"content-encoding" for k, _ in headers)
            if len(body) >= self.minimum_size and not already and ctype.startswith(_COMPRESSIBLE):
                body = gzip.compress(body, compresslevel=self.level, mtime=0)
                headers += [(b"content-encoding", b"gzip"), (b"vary", b"Accept-Encoding")]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, wrapped)
