"""The rollout handler: the life of one environment process, as in the rollout-handler sequence diagram.

Subclass :class:`RolloutHandler` (or :class:`AsyncRolloutHandler` for asyncio environments), implement
``collect()``, and call ``run()``. ``run`` registers the env (waiting while the trainer has not started),
starts the tracker under the server's W&B group, project and unique run name, then loops:

* ``RUNNING``: ``collect()`` one scored group (or a list), send it (``/scored_data`` or
  ``/scored_data_list``);
* ``PAUSED``: generate nothing, sleep until the next status read;
* before each group after a send, and every ``status_interval_s`` otherwise: read ``/status-env``; pause while
  the queued sequences (``queue_size * group_size``) exceed ``off_policy_tolerance * batch_size``, resume when
  they do not. Since every send follows a fresh read showing the queue at or under that threshold, handlers
  sharing a queue overshoot it by at most one ``collect`` result each.

``stop()``, SIGINT or SIGTERM end the loop after the group in hand is sent; the env is then disconnected
and the tracker finished. A group is sent until accepted: connection errors, 5xx and 429 are retried
(see :mod:`rollhub.client.retry`); if the server lost the env (restart without its data) the env is
registered again and the group resent; when retries run out, ``run`` raises :class:`DeliveryError`
carrying the groups; a group the server refuses as invalid raises ``InvalidInput`` with its message.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rollhub.client._core import (
    MAX_REREGISTER_PER_SEND,
    HandlerCore,
    HandlerState,
    HandlerStats,
)
from rollhub.client.env import AsyncEnvClient, EnvClient
from rollhub.client.errors import DeliveryError, ServerUnavailable
from rollhub.errors import NotRegistered, RollhubError, UnknownEnv
from rollhub.experience import Group

log = logging.getLogger("rollhub.client")

#: What ``collect`` returns: a scored group (mapping / ScoredData / Group), a list of them, or None.
Collected = Any
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


@contextmanager
def _stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """In the main thread, turn the first SIGINT/SIGTERM into ``stop()``; a second one acts as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping after the group in hand (send it again to exit at once)", signum)
        for sig, old in previous.items():
            signal.signal(sig, old)
        stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class RolloutHandler(HandlerCore):
    """Base class of a blocking rollout handler; subclasses implement :meth:`collect` and call :meth:`run`.

    Args:
        server_url: the buffer server, e.g. ``http://127.0.0.1:8000``.
        name: the desired env name; the server makes it unique (``name_k``), and that is the W&B run name.
        group_size: sequences per scored group.
        max_token_length: the longest sequence this env produces.
        weight: sampling weight among environments.
        min_batch_allocation: minimum fraction (0..1) of every batch this env should fill, or None.
        off_policy_tolerance: pause while the queued sequences exceed this many batches.
        status_interval_s: how often ``/status-env`` is read while nothing is sent (and how long a paused
            handler sleeps); a running handler also reads it after every send, before its next group.
        tracker: a :class:`~rollhub.client.trackers.Tracker`, or ``"wandb"`` / ``"jsonl:PATH"`` / ``"none"``.
        api_key: bearer key for the server (default ``$ROLLHUB_API_KEY``).
        retry: the retry policy of every request (default: give up after two minutes of failures).
        binary: force msgpack (True) or JSON (False) bodies; None detects what the server accepts.

    Attributes:
        state: the :class:`HandlerState`; ``stats``: the :class:`HandlerStats`; ``env_id`` and
            ``wandb_name``: what the server gave at registration.
    """

    def _init_io(self) -> None:
        self._stop_event = threading.Event()
        self.client = EnvClient(self.server_url, binary=self._binary, **self._http_options)

    def collect(self) -> Collected:
        """Produce one scored group, a list of them, or None (nothing this time).

        A group has the ScoredData fields: ``tokens``, ``masks`` (lists of rows, lists or numpy), ``scores``
        (one per sequence) and optionally ``advantages``, ``ref_logprobs``, ``inference_logprobs``,
        ``messages``, ``generation_params``, ``overrides``, ``group_overrides``, ``policy_version``.
        Call :meth:`log_metrics` here to record env metrics.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement collect()")

    def stop(self) -> None:
        """Ask ``run`` to finish the group in hand, disconnect and return. Safe from any thread."""
        self._stop_event.set()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop_event.is_set()

    def run(self, max_groups: int | None = None) -> HandlerStats:
        """Register, then collect and send until stopped or ``max_groups`` groups were accepted.

        Returns:
            The handler's statistics.

        Raises:
            DeliveryError: groups could not be delivered before the retry policy ran out (attached).
            ServerUnavailable: a ``/status-env`` read failed past the retry policy (no group was in hand:
                the status is read before ``collect``).
            InvalidInput: the server refused a group as invalid (its message says why).
            LifecycleError: ``run`` was already called; a handler runs once.
        """
        self._claim_run()
        try:
            with _stop_on_signals(self.stop):
                if not self._register():
                    return self.stats
                try:
                    self.wandb_info = self.client.wandb_info()
                    self.batch_size = self.client.info().batch_size
                    self._start_tracker()
                    self.state = HandlerState.RUNNING
                    self._loop(max_groups)
                finally:
                    self._disconnect()
                    self._finish_tracker()
        finally:
            self.state = HandlerState.STOPPED
            self.client.close()
        return self.stats

    def _register(self, again: bool = False) -> bool:
        """Register, polling while the trainer has not started; False if stopped first.

        ``again``: the server lost this env (restarted without its data); try at least once even while
        stopping, since the group in hand must still be delivered, and re-read the batch size.
        """
        if self.stopping and not again:
            return False
        while True:
            registration = self.client.register_env(**self._register_body())
            if registration is not None:
                self._registered(registration)
                if again:
                    self.batch_size = self.client.info().batch_size
                return True
            if self.stopping:
                return False
            log.info("%s: waiting for the trainer to start", self.name)
            self._stop_event.wait(self.status_interval_s)

    def _loop(self, max_groups: int | None) -> None:
        next_check = 0.0
        clock = time.monotonic
        while not self.stopping and (max_groups is None or self.stats.groups_sent < max_groups):
            if self._status_due(clock(), next_check):
                self._check_status()
                next_check = clock() + self.status_interval_s
            if self.state is HandlerState.PAUSED:
                self._stop_event.wait(max(0.0, next_check - clock()))
                continue
            groups, as_list = self._prepare(self.collect())
            if groups:
                self._deliver(groups, as_list)

    def _check_status(self) -> None:
        assert self.env_id is not None
        try:
            status = self.client.status_env(self.env_id)
        except (UnknownEnv, NotRegistered):
            if not self._register(again=True):
                return
            status = self.client.status_env(self.env_id)
        self._apply_status(status)

    def _deliver(self, groups: list[Group], as_list: bool) -> None:
        try:
            for _ in range(MAX_REREGISTER_PER_SEND + 1):
                try:
                    self.client.send(groups, as_list=as_list)
                except UnknownEnv:
                    if not self._register(again=True):
                        raise DeliveryError(_LOST_WHILE_STOPPING.format(n=len(groups)), groups=groups) from None
                    self._retag(groups)
                    continue
                self._sent(groups)
                return
            raise DeliveryError(_REFUSED_ENV.format(n=len(groups), k=MAX_REREGISTER_PER_SEND), groups=groups)
        except ServerUnavailable as exc:
            raise DeliveryError(f"{len(groups)} group(s) were not delivered: {exc}", groups=groups) from exc
        except RollhubError as exc:
            _note_undelivered(exc, groups)
            raise

    def _disconnect(self) -> None:
        if self.env_id is None:
            return
        quick = EnvClient(self.server_url, **self._disconnect_options())
        try:
            quick.disconnect_env(self.env_id)
        except Exception as exc:  # the handler is ending either way; say why the server may not know
            log.warning("%s: could not disconnect env %d: %s", self.name, self.env_id, exc)
        finally:
            quick.close()


class AsyncRolloutHandler(HandlerCore):
    """Base class of an asyncio rollout handler; subclasses implement ``async def collect()``.

    The same arguments and life as :class:`RolloutHandler`; ``run`` is a coroutine and ``stop`` may be
    called from the event loop, another thread or a signal handler.
    """

    def _init_io(self) -> None:
        self._stop_flag = threading.Event()
        self._wake: asyncio.Event | None = None
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self.client: AsyncEnvClient | None = None

    async def collect(self) -> Collected:
        """See :meth:`RolloutHandler.collect`."""
        raise NotImplementedError(f"{type(self).__name__} must implement collect()")

    def stop(self) -> None:
        """Ask ``run`` to finish the group in hand, disconnect and return."""
        self._stop_flag.set()
        loop, wake = self._loop_ref, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop_flag.is_set()

    async def _sleep(self, seconds: float) -> None:
        assert self._wake is not None
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, seconds))
        except TimeoutError:
            pass

    async def run(self, max_groups: int | None = None) -> HandlerStats:
        """See :meth:`RolloutHandler.run`."""
        self._claim_run()
        self._loop_ref = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        if self.stopping:
            self._wake.set()
        self.client = AsyncEnvClient(self.server_url, binary=self._binary, **self._http_options)
        try:
            with _stop_on_signals(self.stop):
                if not await self._register():
                    return self.stats
                try:
                    self.wandb_info = await self.client.wandb_info()
                    self.batch_size = (await self.client.info()).batch_size
                    self._start_tracker()
                    self.state = HandlerState.RUNNING
                    await self._loop(max_groups)
                finally:
                    await self._disconnect()
                    self._finish_tracker()
        finally:
            self.state = HandlerState.STOPPED
            await self.client.aclose()
        return self.stats

    async def _register(self, again: bool = False) -> bool:
        """See :meth:`RolloutHandler._register`."""
        assert self.client is not None
        if self.stopping and not again:
            return False
        while True:
            registration = await self.client.register_env(**self._register_body())
            if registration is not None:
                self._registered(registration)
                if again:
                    self.batch_size = (await self.client.info()).batch_size
                return True
            if self.stopping:
                return False
            log.info("%s: waiting for the trainer to start", self.name)
            await self._sleep(self.status_interval_s)

    async def _loop(self, max_groups: int | None) -> None:
        loop = asyncio.get_running_loop()
        next_check = 0.0
        while not self.stopping and (max_groups is None or self.stats.groups_sent < max_groups):
            if self._status_due(loop.time(), next_check):
                await self._check_status()
                next_check = loop.time() + self.status_interval_s
            if self.state is HandlerState.PAUSED:
                await self._sleep(next_check - loop.time())
                continue
            groups, as_list = self._prepare(await self.collect())
            if groups:
                await self._deliver(groups, as_list)

    async def _check_status(self) -> None:
        assert self.client is not None and self.env_id is not None
        try:
            status = await self.client.status_env(self.env_id)
        except (UnknownEnv, NotRegistered):
            if not await self._register(again=True):
                return
            status = await self.client.status_env(self.env_id)
        self._apply_status(status)

    async def _deliver(self, groups: list[Group], as_list: bool) -> None:
        assert self.client is not None
        try:
            for _ in range(MAX_REREGISTER_PER_SEND + 1):
                try:
                    await self.client.send(groups, as_list=as_list)
                except UnknownEnv:
                    if not await self._register(again=True):
                        raise DeliveryError(_LOST_WHILE_STOPPING.format(n=len(groups)), groups=groups) from None
                    self._retag(groups)
                    continue
                self._sent(groups)
                return
            raise DeliveryError(_REFUSED_ENV.format(n=len(groups), k=MAX_REREGISTER_PER_SEND), groups=groups)
        except ServerUnavailable as exc:
            raise DeliveryError(f"{len(groups)} group(s) were not delivered: {exc}", groups=groups) from exc
        except RollhubError as exc:
            _note_undelivered(exc, groups)
            raise

    async def _disconnect(self) -> None:
        if self.env_id is None:
            return
        quick = AsyncEnvClient(self.server_url, **self._disconnect_options())
        try:
            await quick.disconnect_env(self.env_id)
        except Exception as exc:  # the handler is ending either way; say why the server may not know
            log.warning("%s: could not disconnect env %d: %s", self.name, self.env_id, exc)
        finally:
            await quick.aclose()


__all__ = ["AsyncRolloutHandler", "HandlerState", "HandlerStats", "RolloutHandler"]
