"""The one place where client retries live.

Every request the clients make goes through a :class:`Retrier`, which applies one rule:

* a connection error, a timeout or a 5xx answer is retried after a capped exponential backoff with
  jitter, until failures have gone on for ``give_up_after_s`` (then :class:`ServerUnavailable`);
* a 429 is retried after the server's ``Retry-After`` (capped by ``max_retry_after_s``); being throttled
  is the server working as intended, so it never counts towards giving up and it ends a failure streak;
* any other answer (2xx, 3xx, 4xx) is final and handed back to the caller.

Requests are retried as sent, so delivery is at least once: a body whose answer was lost may be stored
twice.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import httpx

from rollhub.client.errors import ServerUnavailable

log = logging.getLogger("rollhub.client")

RETRY_STATUSES = frozenset({408, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often to retry.

    Attributes:
        initial_backoff_s: the first wait after a failure.
        max_backoff_s: the cap of the exponential backoff.
        multiplier: growth of the backoff per consecutive failure.
        jitter: fraction of each wait that is random (0: none, 1: "full jitter"), so clients that failed
            together do not come back together.
        give_up_after_s: stop retrying once failures have gone on this long (None: never give up).
        max_retry_after_s: the longest ``Retry-After`` honoured; longer requests wait this long.
    """

    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5
    give_up_after_s: float | None = 120.0
    max_retry_after_s: float = 60.0

    def backoff(self, failures: int, rng: random.Random) -> float:
        """The wait after the ``failures``-th consecutive failure (1-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** max(0, failures - 1))
        return base * (1.0 - self.jitter * rng.random())


@dataclass(frozen=True)
class RetryEvent:
    """One decision to retry, reported to ``on_retry`` callbacks (for logs, counters and trackers).

    Attributes:
        what: the request, e.g. ``"POST /scored_data"``.
        kind: ``"throttled"`` for a 429, ``"transient"`` for a connection error, timeout or 5xx.
        reason: what happened, in words.
        attempt: the attempt that failed (1-based).
        delay_s: the wait before the next attempt.
    """

    what: str
    kind: Literal["throttled", "transient"]
    reason: str
    attempt: int
    delay_s: float


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (seconds or HTTP-date); None if absent or invalid."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class _Attempts:
    """The state of one request's retries: the failure streak and when it started."""

    def __init__(
        self, policy: RetryPolicy, what: str, rng: random.Random, statuses: frozenset[int] = RETRY_STATUSES
    ) -> None:
        self.policy = policy
        self.statuses = statuses
        self.what = what
        self.rng = rng
        self.attempt = 0
        self.failures = 0
        self.failing_since: float | None = None

    def judge(self, response: httpx.Response) -> RetryEvent | None:
        """None when ``response`` is final, else the retry to make."""
        code = response.status_code
        if code == 429:
            self.failures = 0
            self.failing_since = None
            after = parse_retry_after(response.headers.get("retry-after"))
            if after is None:
                after = self.policy.backoff(1, self.rng)
            delay = min(after, self.policy.max_retry_after_s)
            return RetryEvent(self.what, "throttled", "429 Too Many Requests", self.attempt, delay)
        if code in self.statuses:
            return self.failed(f"{code} {response.reason_phrase}".strip())
        return None

    def failed(self, reason: str) -> RetryEvent:
        """Record a transient failure; raise :class:`ServerUnavailable` when the policy's time is up."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        self.failures += 1
        limit = self.policy.give_up_after_s
        elapsed = now - self.failing_since
        if limit is not None and elapsed >= limit:
            raise ServerUnavailable(
                f"{self.what} kept failing for {elapsed:.0f} s over {self.attempt} attempts "
                f"(last: {reason}); check that the server is running and reachable, or raise "
                f"RetryPolicy.give_up_after_s (now {limit:g} s)",
                what=self.what,
                attempts=self.attempt,
            )
        delay = self.policy.backoff(self.failures, self.rng)
        if limit is not None:
            delay = min(delay, max(0.0, limit - elapsed))
        return RetryEvent(self.what, "transient", reason, self.attempt, delay)


class Retrier:
    """Runs a request under a :class:`RetryPolicy` (:meth:`call`, a coroutine; the blocking clients run it too).

    Args:
        policy: the retry rule; the default gives up after two minutes of failures.
        on_retry: called with every :class:`RetryEvent` before the wait.
        rng: randomness for the jitter (seeded in tests).
    """

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        *,
        on_retry: Callable[[RetryEvent], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy or RetryPolicy()
        self.on_retry = on_retry
        self.rng = rng or random.Random()

    def _report(self, event: RetryEvent) -> None:
        log.log(
            logging.INFO if event.kind == "throttled" else logging.WARNING,
            "%s: %s (attempt %d); retrying in %.2f s",
            event.what,
            event.reason,
            event.attempt,
            event.delay_s,
        )
        if self.on_retry is not None:
            self.on_retry(event)

    async def call(
        self,
        what: str,
        send: Callable[[], Awaitable[httpx.Response]],
        retry_statuses: frozenset[int] = RETRY_STATUSES,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> httpx.Response:
        """Send until the answer is final; return it (which may be a 4xx for the caller to raise).

        Args:
            what: the request in words, for messages.
            send: makes one attempt (a response read in full, so its connection is already released).
            retry_statuses: the statuses retried with backoff (429 is always waited out).
            sleep: waits between attempts (the blocking clients pass one that blocks).
        """
        attempts = _Attempts(self.policy, what, self.rng, retry_statuses)
        while True:
            attempts.attempt += 1
            try:
                response = await send()
            except httpx.TransportError as exc:
                event = attempts.failed(f"{type(exc).__name__}: {exc}".rstrip(": "))
            else:
                event = attempts.judge(response)
                if event is None:
                    return response
            self._report(event)
            await sleep(event.delay_s)


__all__ = ["RETRY_STATUSES", "Retrier", "RetryEvent", "RetryPolicy", "parse_retry_after"]
