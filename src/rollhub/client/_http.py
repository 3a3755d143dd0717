"""The HTTP plumbing shared by every client: base URL, bearer auth, timeouts, and the retrier."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import httpx

from rollhub.client.retry import RETRY_STATUSES, Retrier, RetryEvent, RetryPolicy

API_KEY_ENV = "ROLLHUB_API_KEY"


def _headers(api_key: str | None) -> dict[str, str]:
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    return {"Authorization": f"Bearer {key}"} if key else {}


class SyncHttp:
    """A blocking httpx client whose every request runs under the :class:`Retrier`.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer <key>``; defaults to ``$ROLLHUB_API_KEY``.
        timeout_s: per-request timeout (long-polls add their wait on top).
        retry: the retry policy.
        on_retry: called with every retry decision.
        transport: an httpx transport to use instead of the network (tests, ASGI apps).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        on_retry: Callable[[RetryEvent], None] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retrier = Retrier(retry, on_retry=on_retry)
        self.client = httpx.Client(
            base_url=self.base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )

    def request(
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
            **kwargs: passed to ``httpx.Client.request`` (json, content, params, headers).
        """
        timeout = self.timeout_s + extra_timeout_s
        return self.retrier.call(
            f"{method} {path}",
            lambda: self.client.request(method, path, timeout=timeout, **kwargs),
            retry_statuses,
        )

    def close(self) -> None:
        self.client.close()


class AsyncHttp:
    """The asyncio form of :class:`SyncHttp` (same arguments, ``transport`` is an async transport)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        on_retry: Callable[[RetryEvent], None] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retrier = Retrier(retry, on_retry=on_retry)
        self.client = httpx.AsyncClient(
            base_url=self.base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        extra_timeout_s: float = 0.0,
        retry_statuses: frozenset[int] = RETRY_STATUSES,
        **kwargs: Any,
    ) -> httpx.Response:
        """See :meth:`SyncHttp.request`."""
        timeout = self.timeout_s + extra_timeout_s
        return await self.retrier.acall(
            f"{method} {path}",
            lambda: self.client.request(method, path, timeout=timeout, **kwargs),
            retry_statuses,
        )

    async def aclose(self) -> None:
        await self.client.aclose()
