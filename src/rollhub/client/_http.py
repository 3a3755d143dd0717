"""The HTTP plumbing shared by every client: base URL, bearer auth, timeouts, the retrier, and the I/O mode.

Every client is written once, as coroutines over :class:`Http`. In the asyncio mode ``Http`` sends with an
``httpx.AsyncClient`` and waits with ``asyncio.sleep``. In the blocking mode it sends with an ``httpx.Client``
and waits with ``time.sleep`` inside the coroutine, so a client coroutine never suspends: the blocking faces
run it to its end in the calling thread with :func:`rollhub.client._blocking.drive`, with no event loop and no
thread hop.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import httpx

from rollhub.client.retry import RETRY_STATUSES, Retrier, RetryEvent, RetryPolicy

API_KEY_ENV = "ROLLHUB_API_KEY"


def _headers(api_key: str | None) -> dict[str, str]:
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    return {"Authorization": f"Bearer {key}"} if key else {}


class Http:
    """An httpx client whose every request runs under the :class:`Retrier`.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer <key>``; defaults to ``$ROLLHUB_API_KEY``.
        timeout_s: per-request timeout (long-polls add their wait on top).
        retry: the retry policy.
        on_retry: called with every retry decision.
        transport: an httpx transport to use instead of the network (tests, ASGI/WSGI apps): an async one
            (``httpx.ASGITransport``) for the asyncio clients, a blocking one for the blocking clients.
        blocking: send and wait by blocking calls (the mode of the blocking clients, see the module docstring).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        on_retry: Callable[[RetryEvent], None] | None = None,
        transport: httpx.AsyncBaseTransport | httpx.BaseTransport | None = None,
        blocking: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.blocking = blocking
        self.retrier = Retrier(retry, on_retry=on_retry)
        options: dict[str, Any] = {"base_url": self.base_url, "headers": _headers(api_key), "timeout": timeout_s}
        if blocking:
            self.sync_client: httpx.Client | None = httpx.Client(transport=transport, **options)  # type: ignore[arg-type]
            self.async_client: httpx.AsyncClient | None = None
        else:
            self.sync_client = None
            self.async_client = httpx.AsyncClient(transport=transport, **options)  # type: ignore[arg-type]

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``: ``asyncio.sleep``, or ``time.sleep`` in the blocking mode."""
        if self.sync_client is not None:
            time.sleep(seconds)
        else:
            await asyncio.sleep(seconds)

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if self.sync_client is not None:
            return self.sync_client.request(method, path, **kwargs)
        assert self.async_client is not None
        return await self.async_client.request(method, path, **kwargs)

    async def request(
        self,
        method: str,
        path: str,
        *,
        extra_timeout_s: float = 0.0,
        retry_statuses: frozenset[int] = RETRY_STATUSES,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send with retries; the final answer is returned, whatever its status.

        Args:
            method, path: the route.
            extra_timeout_s: added to the timeout (a long-poll's wait).
            retry_statuses: statuses retried with backoff (see ``Retrier.call``).
            **kwargs: passed to ``httpx``'s ``request`` (json, content, params, headers).
        """
        timeout = self.timeout_s + extra_timeout_s
        return await self.retrier.call(
            f"{method} {path}",
            lambda: self._send(method, path, timeout=timeout, **kwargs),
            retry_statuses,
            sleep=self.sleep,
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self.sync_client is not None:
            self.sync_client.close()
        else:
            assert self.async_client is not None
            await self.async_client.aclose()


class HttpClient:
    """Base of the clients: their :class:`Http` in ``http``, released by ``aclose()`` or ``async with``."""

    http: Http

    async def aclose(self) -> None:
        """Close the connections of this client."""
        await self.http.aclose()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
