"""``AsyncTrainerClient`` (and its blocking face ``TrainerClient``): register a run, pull batches, acknowledge
them, publish policy versions.

``get_batch`` asks for msgpack (``Accept: application/msgpack``) and decodes whatever the server answers into
:class:`~rollhub.experience.Group` objects: a server that only speaks JSON (AtroposLib 0.4.0) answers JSON and
the trainer gets the same groups. ``wait_s`` waits for a batch up to that long in total: on the server
(long-poll) where it supports it, else by polling.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
from pydantic import ValidationError

from rollhub.client._blocking import blocking
from rollhub.client._http import Http
from rollhub.client._queue import QueueClient, QueueFace
from rollhub.client.errors import PolicyVersionConflict, RequestRejected, raise_for_status, server_message
from rollhub.client.types import Batch, PublishedVersion
from rollhub.errors import InvalidInput, NotRegistered, UnknownBatch
from rollhub.experience import Group
from rollhub.wire import codec
from rollhub.wire.group import group_from_json
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


def _served_group(item: Any, index: int, binary: bool) -> Group:
    """One served item as a :class:`Group` (advantage lengths unchecked: a server may be set to allow them)."""
    try:
        if binary:
            return codec.group_from_map(item, check_advantage_lengths=False)
        return group_from_json(item, check_advantage_lengths=False)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or None
        raise InvalidInput(
            f"GET /batch: served group {index} is not a valid ScoredData item ({loc}: {first['msg']}); "
            "the server stored data it should have refused",
            field=loc,
            index=index,
        ) from None
    except InvalidInput as exc:
        exc.add_note(f"GET /batch: in served group {index}")
        raise


def parse_batch(response: httpx.Response) -> Batch | None:
    """Decode a ``GET /batch`` answer (msgpack or JSON) into groups; None when no batch was ready.

    Raises:
        NotRegistered: the server says no trainer is registered.
        InvalidInput: a served group is not a valid ScoredData item (field and group index named).
    """
    raise_for_status(response, "GET /batch")
    binary = response.headers.get("content-type", "").startswith(codec.MEDIA_TYPE)
    data = codec.unpackb(response.content) if binary else orjson.loads(response.content)
    if data.get("status") == "error":
        raise NotRegistered(f"GET /batch: {data.get('message', data)}; call register() first")
    items = data.get("batch")
    if not items:
        return None
    groups = [_served_group(item, i, binary) for i, item in enumerate(items)]
    return Batch(groups=groups, batch_id=data.get("batch_id"), step=data.get("step"))


def _uuid(response: httpx.Response) -> int:
    raise_for_status(response, "POST /register")
    return int(response.json()["uuid"])


def _check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidInput(
            f"policy_version is {version!r}; give the number of weight updates published so far, an int >= 0",
            field="policy_version",
        )
    return version


def _published(response: httpx.Response, version: int) -> PublishedVersion:
    what = "POST /policy-version"
    if response.status_code == 409:
        raise PolicyVersionConflict(
            f"{what} refused policy_version {version} (409): {server_message(response)}; policy_version must "
            "not go backwards: publish the current version or a later one (GET /status shows the current one)",
            policy_version=version,
        )
    if response.status_code in (404, 405):
        raise RequestRejected(
            f"{what} is not served by this server ({response.status_code}): it predates policy versions "
            "(e.g. AtroposLib 0.4.0); run a rollhub server that has the route, or do not publish versions",
            status_code=response.status_code,
        )
    raise_for_status(response, what)
    data = response.json()
    return PublishedVersion(
        policy_version=int(data["policy_version"]), stale_dropped=int(data.get("stale_dropped", 0)), raw=data
    )


def _acked(response: httpx.Response, batch_id: str) -> None:
    raise_for_status(response, f"POST /ack {batch_id!r}", not_found=UnknownBatch)


class AsyncTrainerClient(QueueClient):
    """Trainer-side client. Every call retries connection errors, 5xx and 429 per its policy.

    Args:
        server_url: the buffer server, e.g. ``http://127.0.0.1:8000``.
        **http: ``api_key`` (default ``$ROLLHUB_API_KEY``), ``timeout_s``, ``retry``, ``on_retry``,
            ``transport`` (see ``rollhub.client._http.Http``; ``blocking=True`` is how :class:`TrainerClient`
            builds its core).
    """

    def __init__(self, server_url: str = "http://127.0.0.1:8000", **http: Any) -> None:
        self.http = Http(server_url, **http)

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
        return _uuid(await self.http.request("POST", "/register", json=body))

    async def get_batch(self, *, wait_s: float = 0.0, lease_s: float | None = None) -> Batch | None:
        """``GET /batch``: the next batch of :class:`~rollhub.experience.Group` objects, or None if none was
        ready within ``wait_s`` seconds.

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
            response = await self.http.request(
                "GET", "/batch", params=_batch_params(left, lease_s), headers=_ACCEPT, extra_timeout_s=left
            )
            batch = parse_batch(response)
            left = deadline - time.monotonic()
            if batch is not None or left <= 0:
                return batch
            await self.http.sleep(min(POLL_INTERVAL_S, left))

    async def ack(self, batch_id: str) -> None:
        """``POST /ack``: the leased batch was trained on and may be forgotten.

        Raises:
            UnknownBatch: the id was never leased, was already acknowledged, or its lease expired (the
                batch will be, or was, served again).
        """
        _acked(await self.http.request("POST", "/ack", json={"batch_id": batch_id}), batch_id)

    async def publish_version(self, version: int) -> PublishedVersion:
        """``POST /policy-version``: the trainer now serves weights of ``version`` (updates published so far).

        From then on the server's staleness bound compares items' ``policy_version`` against it.

        Raises:
            InvalidInput: ``version`` is not an int >= 0 (nothing is sent).
            PolicyVersionConflict: the server holds a later version; versions never go backwards.
            RequestRejected: the server has no such route (e.g. AtroposLib 0.4.0).
        """
        checked = _check_version(version)
        response = await self.http.request("POST", "/policy-version", json={"policy_version": checked})
        return _published(response, checked)


class TrainerClient(QueueFace):
    """The blocking face of :class:`AsyncTrainerClient`: the same methods, each returning once answered.

    Args:
        server_url, **http: as for :class:`AsyncTrainerClient`.
    """

    def __init__(self, server_url: str = "http://127.0.0.1:8000", **http: Any) -> None:
        self.core = AsyncTrainerClient(server_url, blocking=True, **http)

    register = blocking(AsyncTrainerClient.register)
    get_batch = blocking(AsyncTrainerClient.get_batch)
    ack = blocking(AsyncTrainerClient.ack)
    publish_version = blocking(AsyncTrainerClient.publish_version)
