"""``AsyncEnvClient`` (and its blocking face ``EnvClient``): the routes a rollout handler uses, one method each.

Groups are sent as binary msgpack (``application/msgpack``) by default. Until a binary body has been
accepted once, a refusal that a JSON-only server gives (415, 422, or 500: AtroposLib 0.4.0 fails with 500
when the body is not UTF-8) is not retried as such: the same groups are sent again as JSON, and if that is
accepted the client remembers that the server speaks JSON only and sends JSON from then on.
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import numpy as np
import orjson
from pydantic import BaseModel, ValidationError

from rollhub.client._blocking import blocking
from rollhub.client._http import Http
from rollhub.client._queue import QueueClient, QueueFace
from rollhub.client.errors import detail_field, raise_for_status, server_message
from rollhub.client.retry import RETRY_STATUSES
from rollhub.client.types import EnvRegistration, EnvStatus
from rollhub.errors import InvalidInput, UnknownEnv
from rollhub.experience.group import FLOAT_FIELDS, INT_FIELDS, VERSION_FIELD, Group, Ragged
from rollhub.wire import codec
from rollhub.wire.group import check_group, group_from_json, group_to_item

log = logging.getLogger("rollhub.client")
GZIP_OVER_BYTES = 64 * 1024
_JSON = {"Content-Type": "application/json"}
_MSGPACK = {"Content-Type": codec.MEDIA_TYPE}


def _rows(value: Any, name: str, kind: str) -> Any:
    """Rows given as numpy (a 2-D array or a list of 1-D arrays) become a Ragged; plain lists pass through."""
    if isinstance(value, np.ndarray):
        if value.ndim != 2:
            raise InvalidInput(f"{name} is a {value.ndim}-D array; give a 2-D array or a list of rows", field=name)
        rows: Sequence[Any] = list(value)
    elif isinstance(value, list | tuple) and any(isinstance(r, np.ndarray) for r in value):
        rows = value
    else:
        return list(value) if isinstance(value, tuple) else value
    arrays = []
    for i, row in enumerate(rows):
        arr = np.asarray(row)
        if arr.size == 0:
            arr = arr.astype(np.int64 if kind == "int" else np.float64)
        if arr.ndim != 1 or arr.dtype.kind not in ("iub" if kind == "int" else "iubf"):
            raise InvalidInput(
                f"{name}[{i}] must be a 1-D row of {'integers' if kind == 'int' else 'numbers'}, "
                f"got shape {arr.shape} dtype {arr.dtype}",
                field=name,
                index=i,
            )
        arrays.append(arr.astype(np.int64) if arr.dtype.kind == "b" else arr)
    dtype = np.result_type(*[a.dtype for a in arrays]) if arrays else np.int64
    return Ragged.from_rows(arrays, dtype)


def to_group(obj: Any, env_id: int | None = None) -> Group:
    """Check one scored group and convert it to a :class:`Group` tagged with ``env_id``.

    Args:
        obj: a ``Group``, a ``ScoredData`` model, or a mapping with the ScoredData fields, whose per-token
            fields may be lists of lists, lists of 1-D numpy arrays or 2-D numpy arrays.
        env_id: the registered env; overrides any env_id in ``obj``.

    Raises:
        InvalidInput: naming the field (and row) at fault; nothing is sent.
    """
    if isinstance(obj, Group):
        group = obj
    else:
        if isinstance(obj, BaseModel):
            obj = obj.model_dump(exclude_none=True)
        if not isinstance(obj, Mapping):
            raise InvalidInput(
                f"a scored group must be a mapping with tokens, masks and scores, got {type(obj).__name__}"
            )
        data = dict(obj)
        for name in (*INT_FIELDS, VERSION_FIELD):
            if data.get(name) is not None:
                data[name] = _rows(data[name], name, "int")
        for name in FLOAT_FIELDS:
            if data.get(name) is not None:
                data[name] = _rows(data[name], name, "float")
        if isinstance(data.get("scores"), tuple):
            data["scores"] = list(data["scores"])
        try:
            group = group_from_json(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(x) for x in first["loc"])
            raise InvalidInput(f"invalid scored group: {loc}: {first['msg']}", field=loc or None) from None
    group.env_id = env_id if env_id is not None else group.env_id
    check_group(group)
    return group


def encode_groups(groups: list[Group], *, as_list: bool, binary: bool) -> tuple[bytes, dict[str, str]]:
    """The request body and headers for ``/scored_data`` (one group) or ``/scored_data_list``.

    Raises:
        InvalidInput: several groups (or none) for ``/scored_data``.
    """
    if not as_list and len(groups) != 1:
        raise InvalidInput(f"/scored_data takes exactly one group, got {len(groups)}; send a list instead")
    if binary:
        maps = [codec.group_to_map(g) for g in groups]
        return codec.packb(maps if as_list else maps[0]), dict(_MSGPACK)
    items = [group_to_item(g) for g in groups]
    body = orjson.dumps(items if as_list else items[0], option=orjson.OPT_SERIALIZE_NUMPY)
    headers = dict(_JSON)
    if len(body) > GZIP_OVER_BYTES:
        body = gzip.compress(body, compresslevel=1)
        headers["Content-Encoding"] = "gzip"
    return body, headers


def _registration(response: httpx.Response) -> EnvRegistration | None:
    raise_for_status(response, "POST /register-env")
    data = response.json()
    if data.get("status") != "success":
        return None
    return EnvRegistration(
        env_id=int(data["env_id"]),
        wandb_name=str(data["wandb_name"]),
        starting_step=int(data.get("starting_step", 0)),
        checkpoint_dir=str(data.get("checkpoint_dir", "")),
        checkpoint_interval=int(data.get("checkpoint_interval", 0)),
        num_steps=int(data.get("num_steps", -1)),
        raw=data,
    )


def _env_status(response: httpx.Response) -> EnvStatus:
    raise_for_status(response, "GET /status-env", not_found=UnknownEnv)
    data = response.json()
    return EnvStatus(
        current_step=int(data["current_step"]),
        queue_size=int(data["queue_size"]),
        env_weight=float(data.get("env_weight", 1.0)),
        self_queue_size=data.get("self_queue_size"),
        raw=data,
    )


def _sent(response: httpx.Response, what: str) -> dict[str, Any]:
    if response.status_code == 422 and detail_field(response) == "env_id":
        raise UnknownEnv(f"{what} was refused: {server_message(response)}; register the env again")
    raise_for_status(response, what)
    return response.json()


def _register_body(
    desired_name: str,
    group_size: int,
    max_token_length: int,
    weight: float,
    min_batch_allocation: float | None,
) -> dict[str, Any]:
    return {
        "max_token_length": max_token_length,
        "desired_name": desired_name,
        "weight": weight,
        "group_size": group_size,
        "min_batch_allocation": min_batch_allocation,
    }


#: Answers a JSON-only server gives to a binary body (0.4.0: 422, or 500 for bytes that are not UTF-8).
NO_BINARY_STATUSES = frozenset({415, 422, 500})
#: While probing for binary support, 500 is an answer to act on rather than to retry.
_PROBE_RETRY_STATUSES = RETRY_STATUSES - {500}


def _needs_json(response: httpx.Response) -> bool:
    """A binary body refused the way a JSON-only server refuses it."""
    return response.status_code in NO_BINARY_STATUSES


class AsyncEnvClient(QueueClient):
    """Client for the rollout-handler routes. Every call retries per its :class:`RetryPolicy`.

    Args:
        server_url: the buffer server.
        binary: True to always send msgpack, False for JSON, None to detect (the default).
        **http: ``api_key``, ``timeout_s``, ``retry``, ``on_retry``, ``transport`` (see ``rollhub.client._http.Http``;
            ``blocking=True`` is how :class:`EnvClient` builds its core).
    """

    def __init__(self, server_url: str, *, binary: bool | None = None, **http: Any) -> None:
        self.http = Http(server_url, **http)
        self.binary = binary

    async def register_env(
        self,
        *,
        desired_name: str,
        group_size: int,
        max_token_length: int,
        weight: float = 1.0,
        min_batch_allocation: float | None = None,
    ) -> EnvRegistration | None:
        """``POST /register-env``; None while the server says to wait for the trainer to start."""
        body = _register_body(desired_name, group_size, max_token_length, weight, min_batch_allocation)
        return _registration(await self.http.request("POST", "/register-env", json=body))

    async def wandb_info(self) -> dict[str, Any]:
        """``GET /wandb_info``: ``{"group", "project"}`` as the trainer registered them (None before)."""
        response = await self.http.request("GET", "/wandb_info")
        raise_for_status(response, "GET /wandb_info")
        return response.json()

    async def status_env(self, env_id: int) -> EnvStatus:
        """``GET /status-env`` (sent with both ``?env_id=`` and the JSON body older servers read).

        Raises:
            UnknownEnv: the server does not know ``env_id`` (e.g. it restarted without its data).
            NotRegistered: no trainer is registered.
        """
        params = {"env_id": env_id}
        return _env_status(await self.http.request("GET", "/status-env", params=params, json=params))

    async def send(self, groups: list[Group], *, as_list: bool | None = None) -> dict[str, Any]:
        """Send scored groups; returns the server's answer (``{"status": "received" | "buffered", ...}``).

        Args:
            groups: checked groups (see :func:`to_group`), already tagged with the env_id.
            as_list: use ``/scored_data_list``; by default only when there is more than one group.

        Raises:
            UnknownEnv: the server no longer knows the groups' env_id; register again and resend.
            InvalidInput: the server refused the data (its message says why); nothing was stored.
            ServerUnavailable: the retry policy ran out; the groups may or may not have been stored.
        """
        as_list = len(groups) != 1 if as_list is None else as_list
        path = "/scored_data_list" if as_list else "/scored_data"
        if self.binary is False:
            return _sent(await self._post(path, groups, as_list, False), f"POST {path}")
        probing = self.binary is None
        response = await self._post(path, groups, as_list, True, probing)
        if probing and _needs_json(response):
            retry = await self._post(path, groups, as_list, False)
            if retry.is_success:
                log.info("%s does not accept msgpack bodies; sending JSON from now on", self.http.base_url)
                self.binary = False
            response = retry
        elif probing and response.is_success:
            self.binary = True
        return _sent(response, f"POST {path}")

    async def _post(
        self, path: str, groups: list[Group], as_list: bool, binary: bool, probing: bool = False
    ) -> httpx.Response:
        body, headers = encode_groups(groups, as_list=as_list, binary=binary)
        statuses = _PROBE_RETRY_STATUSES if probing else RETRY_STATUSES
        return await self.http.request("POST", path, content=body, headers=headers, retry_statuses=statuses)

    async def disconnect_env(self, env_id: int) -> bool:
        """``POST /disconnect-env``; True when the server marked the env disconnected."""
        response = await self.http.request("POST", "/disconnect-env", json={"env_id": env_id})
        raise_for_status(response, "POST /disconnect-env", not_found=UnknownEnv)
        return response.json().get("status") == "success"


class EnvClient(QueueFace):
    """The blocking face of :class:`AsyncEnvClient`: the same methods, each returning once answered.

    Args:
        server_url, binary, **http: as for :class:`AsyncEnvClient`.
    """

    def __init__(self, server_url: str, *, binary: bool | None = None, **http: Any) -> None:
        self.core = AsyncEnvClient(server_url, binary=binary, blocking=True, **http)

    @property
    def binary(self) -> bool | None:
        """True once msgpack bodies were accepted, False once the server proved to speak JSON only."""
        return self.core.binary

    @binary.setter
    def binary(self, value: bool | None) -> None:
        self.core.binary = value

    register_env = blocking(AsyncEnvClient.register_env)
    wandb_info = blocking(AsyncEnvClient.wandb_info)
    status_env = blocking(AsyncEnvClient.status_env)
    send = blocking(AsyncEnvClient.send)
    disconnect_env = blocking(AsyncEnvClient.disconnect_env)
