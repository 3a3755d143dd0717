"""``EnvSession``: one environment's registration on a server, kept across server restarts (register-and-resend).

Both the rollout handler and the Ray fleet's ``HttpWriter`` deliver through it: a send the server refuses
because it no longer knows the env (it restarted without its data) registers the env again, retags the groups
with the new env_id and sends them again, at most :data:`MAX_REREGISTER_PER_SEND` times.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollhub.client.env import AsyncEnvClient
from rollhub.client.errors import DeliveryError, ServerUnavailable
from rollhub.client.types import EnvRegistration, EnvStatus
from rollhub.errors import NotRegistered, RollhubError, UnknownEnv
from rollhub.experience import Group

log = logging.getLogger("rollhub.client")

#: How many times one send may re-register the env (server restarts without its data) before giving up.
MAX_REREGISTER_PER_SEND = 3

#: Awaited after each "no trainer yet" answer with the time registering began; False gives up.
WaitForTrainer = Callable[[float], Awaitable[bool]]
#: Called after each registration with it and whether it replaced an earlier one.
OnRegistered = Callable[[EnvRegistration, bool], Awaitable[None]]

_REFUSED_ENV = (
    "{n} group(s) were refused for an unknown env_id even after registering {k} times; "
    "check that the server keeps its environments"
)
_LOST_WHILE_STOPPING = (
    "{n} group(s) were not delivered: the server no longer knows this env and its trainer had not "
    "restarted when stop() was requested; resend them once the trainer runs"
)


def _note_undelivered(exc: RollhubError, groups: list[Group]) -> None:
    """Say on a refusal (e.g. InvalidInput) that the groups in hand were not delivered."""
    if not isinstance(exc, DeliveryError):
        exc.add_note(f"{len(groups)} group(s) in hand were not delivered because of this error")


class EnvSession:
    """An environment registered on a server through ``client``, registered again whenever the server forgot it.

    Args:
        client: the async env client (the session does not close it).
        fields: the ``register_env`` arguments (``desired_name``, ``group_size``, ``max_token_length``, ...).
        wait: awaited after each answer that the trainer has not started; returns False to stop registering
            (it may also raise, e.g. on a deadline).
        on_registered: awaited after each successful registration.
    """

    def __init__(
        self,
        client: AsyncEnvClient,
        fields: dict[str, Any],
        *,
        wait: WaitForTrainer,
        on_registered: OnRegistered | None = None,
    ) -> None:
        self.client = client
        self.fields = fields
        self.wait = wait
        self.on_registered = on_registered
        self.registration: EnvRegistration | None = None

    @property
    def env_id(self) -> int | None:
        """The env_id of the latest registration (None before the first)."""
        return None if self.registration is None else self.registration.env_id

    async def register(self) -> bool:
        """Register (at least one attempt), waiting while the trainer has not started; False if ``wait`` gave up."""
        started = time.monotonic()
        while True:
            registration = await self.client.register_env(**self.fields)
            if registration is not None:
                replaced = self.registration is not None
                self.registration = registration
                if replaced:
                    log.warning(
                        "%s: the server no longer knew this env; registered again as env_id %d (%s)",
                        self.fields.get("desired_name"),
                        registration.env_id,
                        registration.wandb_name,
                    )
                if self.on_registered is not None:
                    await self.on_registered(registration, replaced)
                return True
            if not await self.wait(started):
                return False

    async def status(self) -> EnvStatus | None:
        """``GET /status-env``, registering again first if the server forgot the env; None if ``wait`` gave up."""
        assert self.env_id is not None, "register() first"
        try:
            return await self.client.status_env(self.env_id)
        except (UnknownEnv, NotRegistered):
            if not await self.register():
                return None
            return await self.client.status_env(self.env_id)

    async def deliver(self, groups: list[Group], *, as_list: bool) -> None:
        """Send ``groups`` until accepted, registering again (and retagging them) when the server forgot the env.

        Raises:
            DeliveryError: the groups (attached) could not be delivered: the retry policy ran out, the env kept
                being unknown, or ``wait`` gave up while registering again.
            RollhubError: the server refused them otherwise (e.g. InvalidInput); a note says they were not
                delivered.
        """
        try:
            for _ in range(MAX_REREGISTER_PER_SEND + 1):
                try:
                    await self.client.send(groups, as_list=as_list)
                    return
                except UnknownEnv:
                    if not await self.register():
                        raise DeliveryError(_LOST_WHILE_STOPPING.format(n=len(groups)), groups=groups) from None
                    for group in groups:
                        group.env_id = self.env_id
            raise DeliveryError(_REFUSED_ENV.format(n=len(groups), k=MAX_REREGISTER_PER_SEND), groups=groups)
        except ServerUnavailable as exc:
            raise DeliveryError(f"{len(groups)} group(s) were not delivered: {exc}", groups=groups) from exc
        except RollhubError as exc:
            _note_undelivered(exc, groups)
            raise
