"""The binary ingest fast path: ``POST /scored_data`` and ``/scored_data_list`` with msgpack bodies.

This is the hot route of a busy buffer (groups of thousands of tokens, hundreds a second), so it skips the
framework: when its first bytes arrive, the body's declared length is reserved against the request memory budget
(:mod:`rollhub.server.budget`: 503 past it, 408 for a stalled sender) and the body is read straight into one
anonymous memory mapping of that length (pre-faulted in one system call), decoded without copying
(:mod:`rollhub.wire.msgview`: the per-token arrays are views of that mapping), validated by the same code as every
other route, and stored as it is. The mapping is the stored group,
so a group costs one copy of its bytes from the socket and no compaction afterwards.

It takes only what it can answer exactly as the general route would: msgpack, a ``Content-Length`` within the
limit, no ``Content-Encoding``, no CORS ``Origin``, a correct API key when one is set. Everything else, and any
body that fails to decode or validate, goes to the general route (with the body replayed when it was read), which
words the error. Refusals by the buffer itself (429 with ``Retry-After`` when the queue is full, 409 and the
like) are answered here with the same JSON.
"""

from __future__ import annotations

import hmac
import mmap
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from rollhub.buffer import ExperienceBuffer, Ingested
from rollhub.errors import RollhubError
from rollhub.experience.group import FLOAT_FIELDS, INT_FIELDS, META_FIELDS, Group, memory_owner
from rollhub.server import shapes
from rollhub.server.budget import BodyRead, EarlyAnswer, RequestBudget
from rollhub.server.errors import rollhub_error_response
from rollhub.server.metrics import LatencyHistograms
from rollhub.server.middleware import ASGIApp, Receive, Scope, Send, replay_body
from rollhub.server.settings import ServerSettings
from rollhub.wire import codec
from rollhub.wire.msgview import unpack_view

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


class _Fallback(Exception):
    """Let the general route answer this request."""


class BinaryIngest:
    """Serves binary ingest requests ahead of the framework; see the module docstring for what it takes.

    Args:
        buffer: the buffer to ingest into.
        settings: body limit, API key, advantage-length check.
        latency: where request latency is recorded (the same histograms as every other route).
        to_group: the general route's decoded-object-to-:class:`Group` conversion (``obj, binary, strict, prefix``).
        summarize_list: turns ``buffer.ingest`` results into the ``/scored_data_list`` answer.
        arrived: called after every successful ingest (wakes long-polling trainers).
        budget: the request memory budget the body is reserved against (see :mod:`rollhub.server.budget`).
    """

    def __init__(
        self,
        buffer: ExperienceBuffer,
        settings: ServerSettings,
        latency: LatencyHistograms,
        to_group: Callable[..., Group],
        summarize_list: Callable[[list[Ingested]], dict[str, Any]],
        arrived: Callable[[], None],
        budget: RequestBudget,
    ) -> None:
        self.buffer = buffer
        self.max_bytes = settings.max_body_bytes
        self.strict = settings.check_advantage_lengths
        self.expected_auth = f"Bearer {settings.api_key}".encode() if settings.api_key else None
        self.latency = latency
        self.to_group = to_group
        self.summarize_list = summarize_list
        self.arrived = arrived
        self.budget = budget
        self.taken = 0  # requests answered here (so tests can tell which path answered)

    def body_length(self, scope: Scope) -> int | None:
        """The declared body length when this request is one the fast path takes, else ``None``."""
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in PATHS:
            return None
        length = ctype = auth = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = value
            elif key == b"content-type":
                ctype = value
            elif key == b"authorization":
                auth = value
            elif key in (b"content-encoding", b"origin", b"transfer-encoding"):
                return None
        if ctype is None or not ctype.startswith(_MEDIA) or length is None or not length.isdigit():
            return None
        n = int(length)
        if not 0 < n <= min(self.max_bytes, self.budget.limit_bytes):  # else the general route answers 413
            return None
        if self.expected_auth is not None and not hmac.compare_digest(auth or b"", self.expected_auth):
            return None
        return n

    async def __call__(self, scope: Scope, receive: Receive, send: Send, general: ASGIApp, length: int) -> None:
        start = time.perf_counter()
        replay = None
        with self.budget.reading() as reading:
            try:
                view = await self._read(reading, receive, length)
            except EarlyAnswer as exc:  # over the memory budget, or too slow
                return await self._answer(scope, send, start, *exc.response())
            if view is None:  # the client went away
                return
            if len(view) != length:  # the server's framing should make this impossible; be exact anyway
                status, body = 400, orjson.dumps({"detail": "request body length does not match Content-Length"})
                headers: list[tuple[bytes, bytes]] = []
            else:
                try:
                    status, headers, body = self._ingest(scope["path"], view)
                except _Fallback:
                    replay = bytes(view)
                    del view  # its memory is released with the reservation; the general path reserves its own
            if replay is None:
                return await self._answer(scope, send, start, status, headers, body)
        return await general(scope, replay_body(replay, receive), send)

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

    async def _answer(
        self, scope: Scope, send: Send, start: float, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        self.taken += 1
        self.latency.observe("POST", scope["path"], status, time.perf_counter() - start)

    def _ingest(self, path: str, view: memoryview) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        many = path == "/scored_data_list"
        try:
            obj = unpack_view(view)
            if many:
                if not isinstance(obj, list):
                    raise _Fallback
                groups = [self.to_group(item, True, self.strict, (i,)) for i, item in enumerate(obj)]
            else:
                groups = [self.to_group(obj, True, self.strict)]
                if _decodes_back_exactly(obj, groups[0], view):
                    groups[0].wire = view
        except Exception:
            raise _Fallback from None  # the general route decodes it again and words the error
        try:
            results = self.buffer.ingest(groups)
        except RollhubError as exc:
            return rollhub_error_response(exc)
        self.arrived()
        answer = self.summarize_list(results) if many else shapes.scored_data(results[0])
        return 200, [], orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)


_STORED_KEYS = frozenset((*INT_FIELDS, *FLOAT_FIELDS, *META_FIELDS, "scores", "env_id", "policy_version"))


def _decodes_back_exactly(obj: Any, group: Group, view: memoryview) -> bool:
    """Whether the body, decoded as storage decodes it, gives ``group`` again: every array of the group is a
    view of the body (so no dtype was converted), no small field needed pydantic, and no key is unknown."""
    if not isinstance(obj, dict) or not _STORED_KEYS.issuperset(obj) or group.meta:
        return False
    region = view.obj
    arrays = [group.scores] + [r.data for r in (group.tokens, group.masks) if r is not None]
    arrays += [r.data for r in (getattr(group, name) for name in FLOAT_FIELDS) if r is not None]
    return all(a.size == 0 or memory_owner(a) is region for a in arrays) and group.scores.dtype == np.float64
