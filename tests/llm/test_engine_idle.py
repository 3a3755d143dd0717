"""The engine idle meter: vLLM's running-requests gauge read from Prometheus text, reads counted as idle, busy or
unanswered (a fake reader), and the meter's thread reading a fake engine's ``/metrics`` over HTTP."""

from __future__ import annotations

import threading
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from tests.run.external_fakes import Served

from rollhub.errors import ConfigError
from rollhub.inference.engine_idle import EngineIdleMeter, IdleCounts, running_requests


def vllm_page(running: float, engines: int = 1) -> str:
    """A page shaped like vLLM's: other families around the gauge, one sample per engine core."""
    lines = [
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 7.0',
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
    ]
    lines += [f'vllm:num_requests_running{{engine="{i}",model_name="m"}} {running}' for i in range(engines)]
    lines += ['vllm:num_requests_running_total_bogus{engine="0"} 9.0', "process_cpu_seconds_total 1.5"]
    return "\n".join(lines) + "\n"


def test_the_running_gauge_is_summed_over_engine_cores_and_absent_is_none() -> None:
    assert running_requests(vllm_page(0.0)) == 0.0
    assert running_requests(vllm_page(3.0, engines=2)) == 6.0
    assert running_requests("vllm:num_requests_running 2\n") == 2.0  # no labels
    assert running_requests("# nothing here\nprocess_cpu_seconds_total 1.5\n") is None
    assert running_requests("") is None


def test_reads_count_as_idle_busy_or_unanswered_and_the_fraction_is_over_answered_reads() -> None:
    answers = iter([vllm_page(2.0), vllm_page(0.0), None, "no gauge here\n", vllm_page(0.0), vllm_page(0.0)])

    def read(url: str) -> str | None:
        assert url == "http://engine-0"
        return next(answers)

    meter = EngineIdleMeter(["http://engine-0"], every_s=1.0, read=read)
    for _ in range(6):
        meter.poll()
    [counts] = meter.counts()
    assert counts == IdleCounts(idle=3, busy=1, unanswered=2)
    assert counts.fraction == 0.75
    summary = meter.summary()
    assert summary["fraction"] == 0.75 and summary["per_engine"] == [0.75]
    assert (summary["idle_reads"], summary["busy_reads"], summary["unanswered_reads"]) == (3, 1, 2)
    assert summary["starting_reads"] == 0


def test_reads_before_an_engines_first_request_are_starting_not_idle() -> None:
    """An engine waiting for the run's workers to start is not a pipeline that fails to feed it: its empty reads
    before the first busy one count apart, and only the empty reads after it are idle."""
    pages = {"http://e0": [0.0, 0.0, None, 0.0, 3.0, 0.0, 1.0], "http://e1": [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]}
    answers = {url: iter(p) for url, p in pages.items()}

    def read(url: str) -> str | None:
        running = next(answers[url])
        return None if running is None else vllm_page(running)

    meter = EngineIdleMeter(list(pages), every_s=1.0, read=read)
    for _ in range(7):
        meter.poll()
    e0, e1 = meter.counts()
    assert e0 == IdleCounts(idle=1, busy=2, unanswered=1, starting=3)
    assert e0.fraction == round(1 / 3, 6)
    assert e1 == IdleCounts(starting=7) and e1.fraction is None  # never given work: no idle fraction
    summary = meter.summary()
    assert summary["starting_reads"] == 10 and summary["idle_reads"] == 1 and summary["fraction"] == round(1 / 3, 6)
    assert summary["per_engine"] == [round(1 / 3, 6), None]


def test_a_reader_that_raises_is_an_unanswered_read_and_engines_are_counted_apart() -> None:
    def read(url: str) -> str | None:
        if url.endswith("1"):
            raise OSError("connection refused")
        return vllm_page(1.0)

    meter = EngineIdleMeter(["http://e0", "http://e1"], every_s=1.0, read=read)
    meter.poll()
    meter.poll()
    assert meter.counts() == [IdleCounts(busy=2), IdleCounts(unanswered=2)]
    assert meter.summary()["per_engine"] == [0.0, None] and meter.summary()["fraction"] == 0.0
    assert IdleCounts().fraction is None


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="every_s is 0"):
        EngineIdleMeter(["http://e0"], every_s=0)


def test_the_meter_reads_a_fake_engines_metrics_page_until_stopped() -> None:
    running = {"now": 0.0}
    served_pages = threading.Event()
    reads = {"n": 0}

    async def metrics(request: Request) -> PlainTextResponse:
        reads["n"] += 1
        if reads["n"] >= 4:
            served_pages.set()
        running["now"] = 1.0 if reads["n"] % 2 else 0.0  # idle and busy by turns
        return PlainTextResponse(vllm_page(running["now"]))

    with Served(Starlette(routes=[Route("/metrics", metrics)])) as engine:
        meter = EngineIdleMeter([engine.url], every_s=0.05).start()
        try:
            assert served_pages.wait(60), "the meter did not read the engine's /metrics"
        finally:
            meter.stop()
    [counts] = meter.counts()
    assert counts.idle >= 1 and counts.busy >= 1
    answered = counts.idle + counts.busy
    time.sleep(0.2)
    assert sum(vars(meter.counts()[0]).values()) == answered + counts.unanswered  # stopped: no more reads
