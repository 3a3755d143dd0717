"""The binary ingest fast path: ``POST /scored_data`` and ``/scored_data_list`` with msgpack bodies.

This is the hot route of a busy buffer (groups of thousands of tokens, hundreds a second), so it skips the
framework's routing and body handling: when its first bytes arrive, the body's declared length is reserved
against the request memory budget (:mod:`rollhub.server.budget`: 503 past it, 408 for a stalled sender) and
the body is read straight into one anonymous memory mapping of that length (pre-faulted in one system call),
then handed as a ``memoryview`` to the same :class:`~rollhub.server.ingest.Ingest` as the routes use
(:func:`rollhub.wire.ingest.decode_groups`: the per-token arrays are views of that mapping). The mapping is the
stored group, so a group costs one copy of its bytes from the socket and no compaction afterwards.

It is ASGI middleware inside the timing, API-key and gzip-response middleware (so those treat it like any
route) and outside body reading. It takes only what it answers exactly as the general route would: msgpack, a
``Content-Length`` the shared :class:`~rollhub.server.middleware.BodyLimits` accept, no ``Content-Encoding``,
no CORS ``Origin``. Everything else goes on to the general route. Errors are rendered by
:func:`rollhub.server.errors.render`, as the routes' exception handlers render them.
"""

from __future__ import annotations

import mmap

import orjson

from rollhub.server.budget import BodyRead, EarlyAnswer
from rollhub.server.errors import render
from rollhub.server.ingest import Ingest
from rollhub.server.middleware import ASGIApp, BodyLimits, Receive, Scope, Send, send_json
from rollhub.wire import codec

PATHS = ("/scored_data", "/scored_data_list")
_MEDIA = codec.MEDIA_TYPE.encode()
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
PREFAULT_MAX = 4 * 2**20
"""Bodies up to this size are pre-faulted in one system call (faster than a fault per page). Larger ones are
faulted as their bytes arrive, so a client that declares a huge body and sends nothing commits no memory."""


MAPPED_MIN = 64 * 1024
"""Smaller bodies are read into an ordinary heap buffer: a mapping of their own would waste most of a page and
one kernel memory area each (a process has about 65,000)."""


def _body_buffer(length: int) -> mmap.mmap | bytearray:
    """Zeroed memory for a body of ``length`` bytes: its own mapping when large, else (or if mapping fails)
    a heap buffer."""
    if length >= MAPPED_MIN:
        try:
            return mmap.mmap(-1, length, flags=_MAP_FLAGS | (_POPULATE if length <= PREFAULT_MAX else 0))
        except OSError:  # out of mappings or address space: the heap still works
            pass
    return bytearray(length)


class BinaryIngest:
    """Serves binary ingest requests ahead of the framework; see the module docstring for what it takes.

    Args:
        ingest: the ingest every route uses.
        limits: the body limits and request memory budget the general path uses too.
    """

    def __init__(self, ingest: Ingest, limits: BodyLimits) -> None:
        self.ingest = ingest
        self.limits = limits
        self.taken = 0  # requests answered here (so tests can tell which path answered)

    def body_length(self, scope: Scope) -> int | None:
        """The declared body length when this request is one the fast path takes, else ``None``."""
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in PATHS:
            return None
        length = ctype = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = value
            elif key == b"content-type":
                ctype = value
            elif key in (b"content-encoding", b"origin", b"transfer-encoding"):
                return None
        if ctype is None or not ctype.startswith(_MEDIA) or length is None or not length.isdigit():
            return None
        n = int(length)
        if n == 0 or self.limits.refusal(n) is not None:  # the general route answers it (413 past a limit)
            return None
        return n

    async def __call__(self, scope: Scope, receive: Receive, send: Send, length: int) -> None:
        """Read, ingest and answer one request that :meth:`body_length` took."""
        with self.limits.budget.reading() as reading:
            try:
                view = await self._read(reading, receive, length)
            except EarlyAnswer as exc:  # over the memory budget, or too slow
                return await send_json(send, *exc.response())
            if view is None:  # the client went away
                return
            if len(view) != length:  # the server's framing should make this impossible; be exact anyway
                body = orjson.dumps({"detail": "request body length does not match Content-Length"})
                return await send_json(send, 400, [], body)
            many = scope["path"] == "/scored_data_list"
            try:
                answer = await self.ingest(view, codec.MEDIA_TYPE, many=many)
            except Exception as exc:  # rendered as the routes' exception handlers render it
                status, headers, body = render(exc, f"POST {scope['path']}")
            else:
                status, headers, body = 200, [], orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
            self.taken += 1
            await send_json(send, status, headers, body)

    async def _read(self, reading: BodyRead, receive: Receive, length: int) -> memoryview | None:
        """The body, read into memory reserved (and pre-faulted) when its first bytes arrive; ``None`` if the
        client went away. Fewer bytes than declared give a shorter view."""
        view: memoryview | None = None
        filled = 0
        while True:
            message = await reading.receive(receive)
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if chunk and view is None:
                reading.reserve(length)
                view = memoryview(_body_buffer(length))
            end = filled + len(chunk)
            if end > length:
                return memoryview(b"")
            if chunk:
                view[filled:end] = chunk  # type: ignore[index]
            filled = end
            if not message.get("more_body", False):
                if view is None or filled < length:
                    return memoryview(b"") if view is None else view[:filled]
                return view


class FastPath:
    """ASGI middleware that lets ``fast`` answer the requests it takes and passes the rest on to ``app``."""

    def __init__(self, app: ASGIApp, fast: BinaryIngest) -> None:
        self.app = app
        self.fast = fast

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = self.fast.body_length(scope) if scope["type"] == "http" else None
        if length is None:
            return await self.app(scope, receive, send)
        await self.fast(scope, receive, send, length)
