"""`HttpWriter`: a RolloutWorker's writer to the buffer server over HTTP (msgpack when the server takes it).

The writer registers with the server as an environment (``POST /register-env``), retrying while the server
answers that the trainer has not started yet (registered and asked for a first batch). Then it sends each
``write`` call's :class:`~rollhub.experience.Group` objects as one ``POST /scored_data_list``, each tagged with
the registered ``env_id`` (``policy_version`` is the one the manager stamped: the version it had loaded).
:class:`~rollhub.client.EnvClient` picks msgpack and falls back to JSON by itself when the server does not
accept binary bodies.

No group is dropped silently: a full queue (429) is not waited out inside the HTTP client but becomes
:class:`rollhub.errors.QueueFull` (with the server's ``Retry-After``) and ``accepted`` = the groups already
stored, so the worker's sender, which can be stopped, waits and resends only the rest; an env the server
forgot (e.g. it restarted) is registered again and the groups resent (the client's
:class:`~rollhub.client.EnvSession`, the same register-and-resend the rollout handler uses); anything else
raises, and the worker counts the unsent items and fails visibly.

The writer is built in the driver and pickled into each worker: it holds settings only until its first use.
"""

from __future__ import annotations

import time
from typing import Any

from rollhub.client._blocking import drive
from rollhub.client.env import EnvClient, to_group
from rollhub.client.retry import RetryEvent
from rollhub.client.session import EnvSession
from rollhub.errors import QueueFull, RollhubError
from rollhub.experience import Group
from rollhub.rollout.protocols import Backlog

#: The pause between registration attempts while no trainer has started.
REGISTER_POLL_S = 0.2


class WriterError(RollhubError):
    """The writer cannot deliver: registration never succeeded, or it was given something it cannot send."""


class HttpWriter:
    """Writes groups to a ``rollhub serve`` (or AtroposLib-compatible) buffer server.

    Args:
        server_url: the buffer server, e.g. ``http://127.0.0.1:8000``.
        env_name: the name registered (the server makes it unique per registration).
        group_size: completions per group (the lesson's ``n_generations``).
        max_token_length: the longest sequence this environment sends.
        register_timeout_s: how long to keep retrying registration while no trainer has registered.
        binary: True for msgpack always, False for JSON, None to detect (the default).
        groups_per_request: the most groups one ``POST /scored_data_list`` carries (a ``write`` of more is sent
            in several requests, so a bounded server queue can take part of it).
    """

    def __init__(
        self,
        server_url: str,
        env_name: str,
        group_size: int,
        max_token_length: int,
        register_timeout_s: float = 120.0,
        binary: bool | None = None,
        groups_per_request: int = 16,
    ) -> None:
        self.server_url = server_url
        self.env_name = env_name
        self.group_size = group_size
        self.max_token_length = max_token_length
        self.register_timeout_s = register_timeout_s
        self.binary = binary
        self.groups_per_request = max(1, groups_per_request)
        self.groups_sent = 0
        self._client: EnvClient | None = None
        self._session: EnvSession | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"], state["_session"] = None, None  # each process opens and registers its own
        return state

    @property
    def env_id(self) -> int | None:
        """The env_id of the latest registration in this process (None before the first)."""
        return None if self._session is None else self._session.env_id

    @property
    def client(self) -> EnvClient:
        """The HTTP client (opened on first use, in the process that writes)."""
        if self._client is None:
            self._client = EnvClient(self.server_url, binary=self.binary, on_retry=self._throttled)
        return self._client

    @property
    def session(self) -> EnvSession:
        """The registration kept across server restarts (register-and-resend), opened on first use."""
        if self._session is None:
            fields = {
                "desired_name": self.env_name,
                "group_size": self.group_size,
                "max_token_length": self.max_token_length,
            }
            self._session = EnvSession(self.client.core, fields, wait=self._wait_for_trainer)
        return self._session

    async def _wait_for_trainer(self, started: float) -> bool:
        if time.monotonic() - started >= self.register_timeout_s:
            raise WriterError(
                f"{self.server_url} still waits for a trainer after {self.register_timeout_s} s; start the "
                "trainer (it must call POST /register) or raise register_timeout_s"
            )
        await self.client.core.http.sleep(REGISTER_POLL_S)
        return True

    def _throttled(self, event: RetryEvent) -> None:
        """Hand a 429 on the data routes to the worker instead of waiting inside the client."""
        if event.kind == "throttled" and "scored_data" in event.what:
            raise QueueFull(
                f"{self.server_url} refused {event.what}: its queue is full; retry in {event.delay_s:.2f} s",
                retry_after_s=event.delay_s,
            )

    def register(self) -> int:
        """Register as an env (retrying until a trainer has registered); returns the env_id.

        Raises:
            WriterError: no trainer started within ``register_timeout_s``.
        """
        drive(self.session.register())
        assert self.env_id is not None
        return self.env_id

    def write(self, items: list[Any]) -> None:
        """Send the groups, ``groups_per_request`` per request, in order.

        Raises:
            QueueFull: the server's queue is full; the first ``accepted`` groups were stored, resend the rest later.
            WriterError: an item is not a Group, or registration timed out.
            RollhubError: the server refused the data or could not be reached (from the client).
        """
        for i, group in enumerate(items):
            if not isinstance(group, Group):
                raise WriterError(f"HttpWriter writes Group objects, got {type(group).__name__} at {i}")
        for start in range(0, len(items), self.groups_per_request):
            try:
                self._send(items[start : start + self.groups_per_request])
            except QueueFull as exc:
                exc.accepted = start  # the worker resends items[start:]
                raise

    def _send(self, items: list[Group]) -> None:
        if not items:
            return
        env_id = self.env_id if self.env_id is not None else self.register()
        groups = [to_group(group, env_id) for group in items]
        drive(self.session.deliver(groups, as_list=True))
        self.groups_sent += len(groups)

    def backlog(self) -> Backlog:
        """The groups waiting at the server to be served, the trainer's published version and the one it trains
        the next batch at (``GET /status``; an AtroposLib server reports neither), registering first if need be."""
        if self.env_id is None:
            self.register()
        status = drive(self.client.core.status())
        return Backlog(int(status.queue_size), status.policy_version, status.next_batch_version)

    def close(self) -> None:
        """Close the HTTP client (nothing is buffered here)."""
        if self._client is not None:
            self._client.close()
            self._client, self._session = None, None
