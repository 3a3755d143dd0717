"""What both clients ask the buffer server about the trainer and its queue: ``GET /info`` and ``GET /status``.

:class:`QueueClient` is the base of :class:`~rollhub.client.AsyncTrainerClient` and
:class:`~rollhub.client.env.AsyncEnvClient`; :class:`QueueFace` of their blocking faces.
"""

from __future__ import annotations

import httpx

from rollhub.client._blocking import BlockingFace, blocking
from rollhub.client._http import HttpClient
from rollhub.client.errors import raise_for_status
from rollhub.client.types import QueueStatus, ServerInfo


def server_info(response: httpx.Response) -> ServerInfo:
    """The :class:`ServerInfo` of a ``GET /info`` answer (raising for an error status)."""
    raise_for_status(response, "GET /info")
    data = response.json()
    return ServerInfo(batch_size=int(data["batch_size"]), max_token_len=int(data["max_token_len"]))


def queue_status(response: httpx.Response) -> QueueStatus:
    """The :class:`QueueStatus` of a ``GET /status`` answer (raising for an error status)."""
    raise_for_status(response, "GET /status")
    data = response.json()
    version, upcoming = data.get("policy_version"), data.get("next_batch_version")
    return QueueStatus(
        current_step=int(data["current_step"]),
        queue_size=int(data["queue_size"]),
        policy_version=None if version is None else int(version),
        next_batch_version=None if upcoming is None else int(upcoming),
        raw=data,
    )


class QueueClient(HttpClient):
    """The questions every client asks about the trainer and the queue."""

    async def info(self) -> ServerInfo:
        """``GET /info``: the trainer's batch size and max token length (-1 before the trainer registers)."""
        return server_info(await self.http.request("GET", "/info"))

    async def status(self) -> QueueStatus:
        """``GET /status``: the trainer step, the number of queued groups and the trainer's published policy
        version (what admission control reads)."""
        return queue_status(await self.http.request("GET", "/status"))


class QueueFace(BlockingFace):
    """The blocking forms of :class:`QueueClient`'s questions (``core`` is a :class:`QueueClient`)."""

    info = blocking(QueueClient.info)
    status = blocking(QueueClient.status)
