"""``TrainerClient`` / ``AsyncTrainerClient``: register a run, pull batches, acknowledge them.

``get_batch`` asks for msgpack (``Accept: application/msgpack``) and decodes whatever the server answers:
a server that only speaks JSON (AtroposLib 0.4.0) answers JSON and that works the same. ``wait_s`` waits
for a batch up to that long in total: on the server (long-poll) where it supports it, else by polling.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson

from rollhub.client._http import AsyncHttp, SyncHttp
from rollhub.client.errors import raise_for_status
from rollhub.client.types import Batch, QueueStatus, ServerInfo
from rollhub.errors import NotRegistered, UnknownBatch
from rollhub.wire import codec
from rollhub.wire.models import Registration

POLL_INTERVAL_S = 0.5
_ACCEPT = {"Accept": f"{codec.MEDIA_TYPE}, application/json;q=0.9"}


def _registration(
    batch_size: int,
    max_token_len: int,
    num_steps: int,
    wandb_group: str,
    wandb_project: str,
    checkpoint_dir: str,
    save_checkpoint_interval: int,
    starting_step: int,
) -> dict[str, Any]:
    return Registration(
        wandb_group=wandb_group,
        wandb_project=wandb_project,
        batch_size=batch_size,
        max_token_len=max_token_len,
        checkpoint_dir=checkpoint_dir,
        save_checkpoint_interval=save_checkpoint_interval,
        starting_step=starting_step,
        num_steps=num_steps,
    ).model_dump()


def _batch_params(wait_s: float, lease_s: float | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if wait_s > 0:
        params["wait_s"] = wait_s
    if lease_s is not None:
        params["lease_s"] = lease_s
    return params


def parse_batch(response: httpx.Response) -> Batch | None:
    """Decode a ``GET /batch`` answer (msgpack or JSON); None when no batch was ready.

    Raises:
        NotRegistered: the server says no trainer is registered.
    """
    raise_for_status(response, "GET /batch")
    if response.headers.get("content-type", "").startswith(codec.MEDIA_TYPE):
        data = codec.unpackb(response.content)
        groups = data.get("batch")
        if groups is not None:
            groups = [codec.map_to_arrays(g) for g in groups]
    else:
        data = orjson.loads(response.content)
        groups = data.get("batch")
    if data.get("status") == "error":
        raise NotRegistered(f"GET /batch: {data.get('message', data)}; call register() first")
    if not groups:
        return None
    return Batch(groups=groups, batch_id=data.get("batch_id"), step=data.get("step"))


def _info(response: httpx.Response) -> ServerInfo:
    raise_for_status(response, "GET /info")
    data = response.json()
    return ServerInfo(batch_size=int(data["batch_size"]), max_token_len=int(data["max_token_len"]))


def _status(response: httpx.Response) -> QueueStatus:
    raise_for_status(response, "GET /status")
    data = response.json()
    return QueueStatus(current_step=int(data["current_step"]), queue_size=int(data["queue_size"]), raw=data)


def _uuid(response: httpx.Response) -> int:
    raise_for_status(response, "POST /register")
    return int(response.json()["uuid"])


def _acked(response: httpx.Response, batch_id: str) -> None:
    raise_for_status(response, f"POST /ack {batch_id!r}", not_found=UnknownBatch)


class TrainerClient:
    """Blocking trainer-side client. Every call retries connection errors, 5xx and 429 per its policy.

    Args:
        server_url: the buffer server, e.g. ``http://127.0.0.1:8000``.
        **http: ``api_key`` (default ``$ROLLHUB_API_KEY``), ``timeout_s``, ``retry``, ``on_retry``,
            ``transport`` (see ``rollhub.client._http.SyncHttp``).
    """

    def __init__(self, server_url: str = "http://127.0.0.1:8000", **http: Any) -> None:
        self.http = SyncHttp(server_url, **http)

    def register(
        self,
        *,
        batch_size: int,
        max_token_len: int,
        num_steps: int,
        wandb_group: str = "",
        wandb_project: str = "",
        checkpoint_dir: str = "",
        save_checkpoint_interval: int = 0,
        starting_step: int = 0,
    ) -> int:
        """``POST /register``: announce the run (``batch_size`` counts sequences); returns the uuid."""
        body = _registration(
            batch_size,
            max_token_len,
            num_steps,
            wandb_group,
            wandb_project,
            checkpoint_dir,
            save_checkpoint_interval,
            starting_step,
        )
        return _uuid(self.http.request("POST", "/register", json=body))

    def info(self) -> ServerInfo:
        """``GET /info``: batch size and max token length (-1 before registration)."""
        return _info(self.http.request("GET", "/info"))

    def status(self) -> QueueStatus:
        """``GET /status``: the trainer step and the number of queued groups."""
        return _status(self.http.request("GET", "/status"))

    def get_batch(self, *, wait_s: float = 0.0, lease_s: float | None = None) -> Batch | None:
        """``GET /batch``: the next batch, or None if none was ready within ``wait_s`` seconds.

        Args:
            wait_s: wait up to this long for a batch (server long-poll, else polling every 0.5 s).
            lease_s: lease the batch: the server serves it again unless ``ack(batch.batch_id)`` comes
                within ``lease_s`` seconds (servers without leases ignore it and set no batch_id).

        Raises:
            NotRegistered: ``register`` was not called on this server.
        """
        deadline = time.monotonic() + wait_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            response = self.http.request(
                "GET", "/batch", params=_batch_params(left, lease_s), headers=_ACCEPT, extra_timeout_s=left
            )
            batch = parse_batch(response)
            left = deadline - time.monotonic()
            if batch is not None or left <= 0:
                return batch
            time.sleep(min(POLL_INTERVAL_S, left))

    def ack(self, batch_id: str) -> None:
        """``POST /ack``: the leased batch was trained on and may be forgotten.

        Raises:
            UnknownBatch: the id was never leased, was already acknowledged, or its lease expired (the
                batch will be, or was, served again).
        """
        _acked(self.http.request("POST", "/ack", json={"batch_id": batch_id}), batch_id)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTrainerClient:
    """The asyncio form of :class:`TrainerClient` (same methods, awaited; ``aclose()`` to release it)."""

    def __init__(self, server_url: str = "http://127.0.0.1:8000", **http: Any) -> None:
        self.http = AsyncHttp(server_url, **http)

    async def register(
        self,
        *,
        batch_size: int,
        max_token_len: int,
        num_steps: int,
        wandb_group: str = "",
        wandb_project: str = "",
        checkpoint_dir: str = "",
        save_checkpoint_interval: int = 0,
        starting_step: int = 0,
    ) -> int:
        """See :meth:`TrainerClient.register`."""
        body = _registration(
            batch_size,
            max_token_len,
            num_steps,
            wandb_group,
            wandb_project,
            checkpoint_dir,
            save_checkpoint_interval,
            starting_step,
        )
        return _uuid(await self.http.request("POST", "/register", json=body))

    async def info(self) -> ServerInfo:
        """See :meth:`TrainerClient.info`."""
        return _info(await self.http.request("GET", "/info"))

    async def status(self) -> QueueStatus:
        """See :meth:`TrainerClient.status`."""
        return _status(await self.http.request("GET", "/status"))

    async def get_batch(self, *, wait_s: float = 0.0, lease_s: float | None = None) -> Batch | None:
        """See :meth:`TrainerClient.get_batch`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            left = max(0.0, deadline - loop.time())
            response = await self.http.request(
                "GET", "/batch", params=_batch_params(left, lease_s), headers=_ACCEPT, extra_timeout_s=left
            )
            batch = parse_batch(response)
            left = deadline - loop.time()
            if batch is not None or left <= 0:
                return batch
            await asyncio.sleep(min(POLL_INTERVAL_S, left))

    async def ack(self, batch_id: str) -> None:
        """See :meth:`TrainerClient.ack`."""
        _acked(await self.http.request("POST", "/ack", json={"batch_id": batch_id}), batch_id)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncTrainerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
