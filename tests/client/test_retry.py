"""The retry rule: transient failures back off (capped, jittered) and give up with a reason; 429 waits out
Retry-After without counting as a failure; any other answer is final."""

from __future__ import annotations

import asyncio
import email.utils
import random
import time

import httpx
import pytest

from rollhub.client import RetryEvent, RetryPolicy, ServerUnavailable
from rollhub.client.retry import Retrier, parse_retry_after
from tests.conftest import free_port

FAST = RetryPolicy(initial_backoff_s=0.001, max_backoff_s=0.01, give_up_after_s=30.0)


def scripted(*answers: int | Exception, retry_after: str = "0") -> tuple[httpx.AsyncClient, list[int]]:
    """A client whose transport answers with the given statuses (or raises the given errors) in turn."""
    seen: list[int] = []
    queue = list(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(len(seen) + 1)
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, Exception):
            raise answer
        headers = {"Retry-After": retry_after} if answer == 429 else {}
        return httpx.Response(answer, headers=headers, json={"n": len(seen)})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test"), seen


def test_backoff_grows_to_its_cap_and_jitter_stays_within_the_fraction() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(0)
    for failures, base in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (30, 1.0)]:
        delays = [policy.backoff(failures, rng) for _ in range(200)]
        assert all(base * 0.5 <= d <= base for d in delays), (failures, min(delays), max(delays))
        assert max(delays) - min(delays) > base * 0.3, "jitter must spread the waits"


def test_parse_retry_after_reads_seconds_and_http_dates() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    now = time.time()
    date = email.utils.formatdate(now + 10, usegmt=True)
    assert 8.0 <= parse_retry_after(date, now=now) <= 10.5  # type: ignore[operator]
    assert parse_retry_after(email.utils.formatdate(now - 100, usegmt=True), now=now) == 0.0


def test_5xx_and_connection_errors_are_retried_until_success() -> None:
    events: list[RetryEvent] = []
    client, seen = scripted(503, httpx.ConnectError("refused"), 500, 200)
    retrier = Retrier(FAST, on_retry=events.append)
    answer = asyncio.run(retrier.call("GET /x", lambda: client.get("/x")))
    assert answer.status_code == 200 and len(seen) == 4
    assert [e.kind for e in events] == ["transient"] * 3
    assert "ConnectError" in events[1].reason and events[0].reason.startswith("503")


def test_429_waits_the_servers_retry_after_and_does_not_count_towards_giving_up() -> None:
    events: list[RetryEvent] = []
    client, _ = scripted(429, 429, 429, 200, retry_after="0.02")
    policy = RetryPolicy(initial_backoff_s=0.001, give_up_after_s=0.0)  # any transient failure gives up at once
    answer = asyncio.run(Retrier(policy, on_retry=events.append).call("POST /scored_data", lambda: client.post("/x")))
    assert answer.status_code == 200
    assert [e.kind for e in events] == ["throttled"] * 3
    assert all(e.delay_s == pytest.approx(0.02) for e in events)


def test_retry_after_is_capped_by_the_policy() -> None:
    events: list[RetryEvent] = []
    client, _ = scripted(429, 200, retry_after="3600")
    policy = RetryPolicy(max_retry_after_s=0.01)
    asyncio.run(Retrier(policy, on_retry=events.append).call("POST /x", lambda: client.post("/x")))
    assert events[0].delay_s == pytest.approx(0.01)


def test_4xx_is_final_and_returned_to_the_caller() -> None:
    client, seen = scripted(422)
    assert asyncio.run(Retrier(FAST).call("POST /x", lambda: client.post("/x"))).status_code == 422
    assert len(seen) == 1


def test_gives_up_with_the_reason_when_failures_outlast_the_policy() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    policy = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.02, give_up_after_s=0.2)
    client = httpx.AsyncClient(base_url=dead)
    with pytest.raises(ServerUnavailable) as info:
        asyncio.run(Retrier(policy).call("POST /scored_data", lambda: client.post("/scored_data")))
    assert "POST /scored_data" in str(info.value) and "ConnectError" in str(info.value)
    assert info.value.attempts > 1


def test_statuses_outside_the_retry_set_are_final() -> None:
    client, seen = scripted(500, 200)
    answer = asyncio.run(Retrier(FAST).call("POST /x", lambda: client.post("/x"), frozenset({503})))
    assert answer.status_code == 500 and len(seen) == 1
