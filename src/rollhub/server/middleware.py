"""Pure-ASGI middleware: API-key check, body size limit and memory budget with gzip request bodies, gzip
responses. The binary fast path (:mod:`rollhub.server.fastpath`) sits among them and uses the same limits
(:class:`BodyLimits`) and the same way of answering (:func:`send_json`).

They run before routing, so their answers are plain HTTP errors with a message that says what to do.
"""

from __future__ import annotations

import gzip
import hmac
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from rollhub.server.budget import BodyRead, EarlyAnswer, RequestBudget

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


async def send_json(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """Answer with the JSON ``body``: the one way pure-ASGI code (middleware, the binary fast path) answers."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_json(send, status, headers or [], orjson.dumps({"detail": message}))


class BodyLimits:
    """The limits every request body is held to, on the general path and the binary fast path alike.

    Args:
        max_bytes: largest body (after gzip inflation), ``max_body_bytes``.
        budget: the request memory budget bodies are reserved against.
    """

    def __init__(self, max_bytes: int, budget: RequestBudget) -> None:
        self.max_bytes = max_bytes
        self.budget = budget

    def refusal(self, declared: int) -> str | None:
        """Why a body that declares ``declared`` bytes is refused at once (answer 413), or ``None``."""
        if declared > self.max_bytes:
            return f"request body of {declared} bytes is over the limit of {self.max_bytes}"
        return self.budget.too_large(declared)


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
                f"API key {what}: send the header 'Authorization: Bearer KEY' where KEY is the server's --api-key",
                [(b"www-authenticate", b"Bearer")],
            )
        return await self.app(scope, receive, send)


class BodyMiddleware:
    """Read the whole request body once: enforce ``max_bytes`` (413) and inflate ``Content-Encoding: gzip``
    (400 when the gzip is corrupt), so routes always see the plain body.

    The body's memory (received chunks, then the inflated body) is reserved against ``budget`` as it arrives
    (503 with ``Retry-After`` past it) and released when the request ends; a sender too slow for the budget's
    read timeouts is answered 408.
    """

    def __init__(self, app: ASGIApp, limits: BodyLimits) -> None:
        self.app = app
        self.max_bytes = limits.max_bytes
        self.budget = limits.budget
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (
            scope.get("method") in ("GET", "HEAD", "OPTIONS") and not _header(scope, b"content-length")
        ):
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and (why := self.limits.refusal(int(declared))) is not None:
            return await _error(send, 413, why)
        with self.budget.reading() as reading:
            try:
                body = await self._read(reading, receive)
                if body is None:  # the client went away
                    return
                encoding = (_header(scope, b"content-encoding") or b"").lower()
                if b"gzip" in encoding:
                    body = _inflate(body, limit, reading)
                    scope = dict(scope)
                    scope["headers"] = [
                        (k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")
                    ] + [(b"content-length", str(len(body)).encode())]
            except EarlyAnswer as exc:
                return await send_json(send, *exc.response())
            return await self.app(scope, replay_body(body, receive), send)

    async def _read(self, reading: BodyRead, receive: Receive) -> bytes | None:
        chunks, size, limit = [], 0, self.max_bytes
        while True:
            message = await reading.receive(receive)
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _TooLarge(f"request body is over the limit of {limit} bytes")
            if chunk:
                reading.reserve(len(chunk))
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(EarlyAnswer):
    status = 413


_INFLATE_STEP = 1 << 20


def _inflate(body: bytes, limit: int, reading: BodyRead) -> bytes:
    """The gzip ``body`` inflated, reserving its memory step by step (413 past ``limit``, 400 when corrupt)."""
    if not body:
        return body
    inflater, parts, size, data = zlib.decompressobj(16 + zlib.MAX_WBITS), [], 0, body
    try:
        while True:
            part = inflater.decompress(data, _INFLATE_STEP)
            size += len(part)
            if size > limit:
                raise _TooLarge(f"decompressed request body is over the limit of {limit} bytes")
            reading.reserve(len(part))
            parts.append(part)
            data = inflater.unconsumed_tail
            if inflater.eof or (not data and len(part) < _INFLATE_STEP):
                break
        if not inflater.eof:
            raise zlib.error("truncated gzip stream")
    except zlib.error as exc:
        raise EarlyAnswer(f"Invalid gzip payload: {exc}; send valid gzip or drop the header") from None
    reading.release(len(body))  # the compressed body is dropped once inflated
    return b"".join(parts)


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
