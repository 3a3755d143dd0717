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

The life is written once, as coroutines (:class:`HandlerLoop`): :class:`AsyncRolloutHandler` awaits it, and
:class:`RolloutHandler` drives it in the thread that calls ``run()`` with blocking I/O (see
:mod:`rollhub.client._http`), so its blocking ``collect()`` runs in that thread.
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

from rollhub.client._blocking import drive
from rollhub.client._core import HandlerCore, HandlerState, HandlerStats
from rollhub.client.env import AsyncEnvClient
from rollhub.client.session import EnvSession
from rollhub.client.types import EnvRegistration

log = logging.getLogger("rollhub.client")

#: What ``collect`` returns: a scored group (mapping / ScoredData / Group), a list of them, or None.
Collected = Any


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


class HandlerLoop(HandlerCore):
    """The life of a rollout handler as coroutines: register, loop (status, collect, deliver), disconnect.

    Subclasses say how one ``collect`` result is obtained (:meth:`_collect_once`), how to sleep until woken by
    ``stop`` (:meth:`_sleep`) and whether the I/O blocks (``BLOCKING_IO``). ``stop`` may be called from the
    handler's thread or event loop, another thread or a signal handler. The arguments are documented on
    :class:`RolloutHandler`.
    """

    BLOCKING_IO = False

    def __init__(self, server_url: str, **settings: Any) -> None:
        super().__init__(server_url, **settings)
        self._stop_flag = threading.Event()
        self._wake: asyncio.Event | None = None
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self.client: AsyncEnvClient | None = None
        self._session: EnvSession | None = None

    async def _collect_once(self) -> Collected:
        """One ``collect()`` result."""
        raise NotImplementedError

    def stop(self) -> None:
        """Ask ``run`` to finish the group in hand, disconnect and return. Safe from any thread."""
        self._stop_flag.set()
        loop, wake = self._loop_ref, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop has closed: run has returned already
                pass

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop_flag.is_set()

    async def _sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` or until :meth:`stop` is called."""
        raise NotImplementedError

    async def _run(self, max_groups: int | None) -> HandlerStats:
        self._claim_run()
        self.client = AsyncEnvClient(
            self.server_url, binary=self._binary, blocking=self.BLOCKING_IO, **self._http_options
        )
        self._session = EnvSession(
            self.client, self._register_body(), wait=self._wait_for_trainer, on_registered=self._on_registered
        )
        try:
            with _stop_on_signals(self.stop):
                if self.stopping or not await self._session.register():
                    return self.stats
                try:
                    await self._start()
                    await self._loop(max_groups)
                finally:
                    await self._disconnect()
                    self._finish_tracker()
        finally:
            self.state = HandlerState.STOPPED
            await self.client.aclose()
        return self.stats

    async def _start(self) -> None:
        assert self.client is not None
        self.wandb_info = await self.client.wandb_info()
        self.batch_size = (await self.client.info()).batch_size
        self._start_tracker()
        self.state = HandlerState.RUNNING

    async def _wait_for_trainer(self, started: float) -> bool:
        if self.stopping:
            return False
        log.info("%s: waiting for the trainer to start", self.name)
        await self._sleep(self.status_interval_s)
        return True

    async def _on_registered(self, registration: EnvRegistration, replaced: bool) -> None:
        self._registered(registration, replaced)
        if replaced:  # a new trainer run may have another batch size
            assert self.client is not None
            self.batch_size = (await self.client.info()).batch_size

    async def _loop(self, max_groups: int | None) -> None:
        assert self._session is not None
        clock = time.monotonic
        next_check = 0.0
        while not self.stopping and (max_groups is None or self.stats.groups_sent < max_groups):
            if self._status_due(clock(), next_check):
                status = await self._session.status()
                if status is not None:
                    self._apply_status(status)
                next_check = clock() + self.status_interval_s
            if self.state is HandlerState.PAUSED:
                await self._sleep(next_check - clock())
                continue
            groups, as_list = self._prepare(await self._collect_once())
            if groups:
                await self._session.deliver(groups, as_list=as_list)
                self._sent(groups)

    async def _disconnect(self) -> None:
        if self.env_id is None:
            return
        quick = AsyncEnvClient(self.server_url, blocking=self.BLOCKING_IO, **self._disconnect_options())
        try:
            await quick.disconnect_env(self.env_id)
        except Exception as exc:  # the handler is ending either way; say why the server may not know
            log.warning("%s: could not disconnect env %d: %s", self.name, self.env_id, exc)
        finally:
            await quick.aclose()


class RolloutHandler(HandlerLoop):
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

    def collect(self) -> Collected:
        """Produce one scored group, a list of them, or None (nothing this time).

        A group has the ScoredData fields: ``tokens``, ``masks`` (lists of rows, lists or numpy), ``scores``
        (one per sequence) and optionally ``advantages``, ``ref_logprobs``, ``inference_logprobs``,
        ``messages``, ``generation_params``, ``overrides``, ``group_overrides``, ``policy_version``.
        Call :meth:`log_metrics` here to record env metrics. It runs in the thread that called ``run``.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement collect()")

    BLOCKING_IO = True

    async def _collect_once(self) -> Collected:
        return self.collect()

    async def _sleep(self, seconds: float) -> None:
        self._stop_flag.wait(max(0.0, seconds))

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
        return drive(self._run(max_groups))


class AsyncRolloutHandler(HandlerLoop):
    """Base class of an asyncio rollout handler; subclasses implement ``async def collect()``.

    The same arguments and life as :class:`RolloutHandler`; ``run`` is a coroutine and ``stop`` may be
    called from the event loop, another thread or a signal handler.
    """

    async def collect(self) -> Collected:
        """See :meth:`RolloutHandler.collect`."""
        raise NotImplementedError(f"{type(self).__name__} must implement collect()")

    async def _collect_once(self) -> Collected:
        return await self.collect()

    async def _sleep(self, seconds: float) -> None:
        assert self._wake is not None
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, seconds))
        except TimeoutError:
            pass

    async def run(self, max_groups: int | None = None) -> HandlerStats:
        """See :meth:`RolloutHandler.run`."""
        self._loop_ref = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        if self.stopping:
            self._wake.set()
        return await self._run(max_groups)


__all__ = ["AsyncRolloutHandler", "HandlerLoop", "HandlerState", "HandlerStats", "RolloutHandler"]
