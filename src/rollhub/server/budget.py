"""One global budget for the memory of request bodies, and body reads that time out.

Every request body the server holds (the binary fast path's pre-faulted mapping, the general path's buffered
chunks and their gzip inflation) is reserved against :class:`RequestBudget` before its memory is committed and
released when the request ends. A reservation past the budget is refused with 503, ``Retry-After`` and a
message naming ``max_request_memory_bytes``; nothing of the request was stored.

Memory is reserved as bytes arrive, never at the declaration: a connection that declares a large
``Content-Length`` and sends nothing holds no memory. The fast path reserves its whole declared length when the
first bytes arrive (it pre-faults the body's mapping in one system call); the general path reserves chunk by
chunk. A body whose sender stalls longer than ``body_idle_timeout_s`` between chunks, or that is not complete
``body_timeout_s`` after its read began, is answered 408 and its memory released.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
_CLOSE = (b"connection", b"close")  # the unread rest of a refused body must not be parsed as the next request


class EarlyAnswer(Exception):
    """A request answered before its body reached a route (its memory is released)."""

    status = 400

    def __init__(self, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = [*(headers or []), _CLOSE]

    def response(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """(status, extra headers, JSON body) of the answer."""
        return self.status, self.headers, orjson.dumps({"detail": self.message})


class BudgetFull(EarlyAnswer):
    """The request memory budget cannot hold this body now (answered 503 with ``Retry-After``)."""

    status = 503


class BodyTimeout(EarlyAnswer):
    """The body did not arrive in time (answered 408)."""

    status = 408


class RequestBudget:
    """Bytes of request bodies held at once, across all connections, and the limits of one body read.

    Single event loop: reservations are plain arithmetic, with no lock.

    Args:
        limit_bytes: most request-body memory held at once (``max_request_memory_bytes``).
        idle_timeout_s: longest wait for the next chunk of a body (``body_idle_timeout_s``).
        total_timeout_s: longest a whole body may take to arrive (``body_timeout_s``).
        retry_after_s: the ``Retry-After`` suggested with a 503.

    Attributes:
        in_flight_bytes: bytes reserved now.
        bodies_in_flight: request bodies being read or held now.
        refused: bodies refused with 503 since start.
        timeouts: bodies answered 408 since start, by reason (``idle`` or ``deadline``).
    """

    def __init__(self, limit_bytes: int, idle_timeout_s: float, total_timeout_s: float, retry_after_s: float) -> None:
        self.limit_bytes = limit_bytes
        self.idle_timeout_s = idle_timeout_s
        self.total_timeout_s = total_timeout_s
        self.retry_after = str(max(1, round(retry_after_s))).encode()
        self.in_flight_bytes = 0
        self.bodies_in_flight = 0
        self.refused = 0
        self.timeouts = {"idle": 0, "deadline": 0}

    def too_large(self, length: int) -> str | None:
        """Why a body of ``length`` bytes can never fit the budget (answer 413), or ``None`` when it can."""
        if length <= self.limit_bytes:
            return None
        return (
            f"request body of {length} bytes is over the request memory budget of {self.limit_bytes} bytes "
            "(max_request_memory_bytes, --max-request-memory-mb); send a smaller body or raise the budget"
        )

    def reading(self) -> BodyRead:
        """Start reading one body; use as a context manager so its memory is always released."""
        return BodyRead(self)

    def lines(self) -> list[str]:
        """The budget's figures in Prometheus text format."""
        out: list[str] = []
        for name, kind, value, help_ in (
            ("rollhub_request_memory_limit_bytes", "gauge", self.limit_bytes, "Request memory budget."),
            ("rollhub_request_body_bytes_in_flight", "gauge", self.in_flight_bytes, "Request body bytes reserved."),
            ("rollhub_request_bodies_in_flight", "gauge", self.bodies_in_flight, "Request bodies being read."),
            ("rollhub_request_budget_refused_total", "counter", self.refused, "Bodies refused with 503 (budget)."),
        ):
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"])
        name = "rollhub_request_body_timeouts_total"
        out.extend([f"# HELP {name} Bodies answered 408 (read timeout).", f"# TYPE {name} counter"])
        out.extend(f'{name}{{reason="{k}"}} {v}' for k, v in sorted(self.timeouts.items()))
        return out


class BodyRead:
    """One body being read: its reservation against the budget and its read deadlines.

    ``receive()`` raises :class:`BodyTimeout` past a deadline; ``reserve()`` raises :class:`BudgetFull` past the
    budget. Leaving the context releases everything this body reserved.
    """

    def __init__(self, budget: RequestBudget) -> None:
        self.budget = budget
        self.reserved = 0
        self._task: asyncio.Task[Any] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._expired: str | None = None

    def __enter__(self) -> BodyRead:
        self.budget.bodies_in_flight += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()
        self.release(self.reserved)
        self.budget.bodies_in_flight -= 1

    def reserve(self, n: int) -> None:
        """Reserve ``n`` more bytes for this body, or raise :class:`BudgetFull`."""
        b = self.budget
        if b.in_flight_bytes + n > b.limit_bytes:
            b.refused += 1
            raise BudgetFull(
                f"the request memory budget of {b.limit_bytes} bytes is in use ({b.in_flight_bytes} bytes held by "
                f"{b.bodies_in_flight} request bodies; max_request_memory_bytes, --max-request-memory-mb): "
                f"retry after {b.retry_after.decode()} s (nothing of this request was stored)",
                [(b"retry-after", b.retry_after)],
            )
        b.in_flight_bytes += n
        self.reserved += n

    def release(self, n: int) -> None:
        """Give back ``n`` of this body's reserved bytes (its memory was freed)."""
        n = min(n, self.reserved)
        self.reserved -= n
        self.budget.in_flight_bytes -= n

    async def receive(self, receive: Receive) -> Message:
        """The next ASGI message of the body, or :class:`BodyTimeout` when the sender is too slow."""
        loop = asyncio.get_running_loop()
        if self._task is None:  # first call: one timer per body, re-armed lazily (no cost per chunk)
            self._task = asyncio.current_task()
            self._deadline = loop.time() + self.budget.total_timeout_s
            self._last = loop.time()
            self._arm(loop)
        try:
            message = await receive()
        except asyncio.CancelledError:
            if self._expired is None or self._task is None:
                raise
            self._task.uncancel()
            self.budget.timeouts[self._expired] += 1
            raise BodyTimeout(self._timeout_message(self._expired)) from None
        self._last = loop.time()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.done()  # the read is over: the timer must not cancel what the request awaits next
        return message

    def done(self) -> None:
        """The body is read: stop the read timer."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = loop.call_at(min(self._last + self.budget.idle_timeout_s, self._deadline), self._check)

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now >= self._deadline:
            self._expired = "deadline"
        elif now - self._last >= self.budget.idle_timeout_s:
            self._expired = "idle"
        else:  # bytes came since the timer was set: wait from the latest arrival
            return self._arm(loop)
        self._handle = None
        if self._task is not None:
            self._task.cancel()

    def _timeout_message(self, reason: str) -> str:
        b = self.budget
        if reason == "idle":
            what = f"no bytes of the body arrived for {b.idle_timeout_s:g} s (body_idle_timeout_s, --body-idle-timeout)"
        else:
            what = f"the body was not complete within {b.total_timeout_s:g} s (body_timeout_s, --body-timeout)"
        return f"request body read timed out: {what}; send the whole body promptly"
