"""How much of the time an inference engine had nothing to generate: its idle fraction, from polling vLLM's own
Prometheus page.

vLLM's ``/metrics`` carries the gauge ``vllm:num_requests_running``: the requests in the engine's model-execution
batches, updated by the scheduler after every engine step (so it falls to 0 once the last request finished).
:class:`EngineIdleMeter` reads it every ``every_s`` seconds from each engine and counts each read as **idle**
(no request running), **busy** (one or more), or **unanswered** (no answer, an error status, or no such gauge:
an engine restarting or down, or one started with ``--disable-log-stats``). Reads that find no request running
before the engine's first busy read count as **starting**, not idle: the run is still starting its workers (Ray,
the fleet, the first evaluation's set-up), which says nothing about how well the pipeline feeds the engine once
it runs. The idle fraction of an engine is idle reads over idle + busy reads: an estimate, by sampling at a fixed
interval, of the share of the time the engine was reachable and ran no request, from its first request on.

What it counts and what it does not: a request waiting in the engine's queue (``vllm:num_requests_waiting``) but
not yet scheduled is not running, so a read that finds only waiting requests counts as idle (rare: the scheduler
admits waiting requests at its next step unless the KV cache is full); a weight push that pauses the engine makes
it idle for as long as no request runs; gaps between requests shorter than ``every_s`` are seen only in
proportion to how often a read falls into them (the estimate is unbiased for a poll clock that is independent of
the request pattern, and its resolution is about ``every_s``); time an engine was down is unanswered, never idle.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollhub.errors import ConfigError

logger = logging.getLogger(__name__)

RUNNING_GAUGE = "vllm:num_requests_running"


def running_requests(text: str) -> float | None:
    """The sum of every ``vllm:num_requests_running`` sample (one per engine core and model) in Prometheus
    text; ``None`` when the page has none."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(RUNNING_GAUGE):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name != RUNNING_GAUGE:
            continue
        try:
            total += float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        seen = True
    return total if seen else None


@dataclass
class IdleCounts:
    """One engine's reads so far: ``idle`` (no request running), ``busy``, ``unanswered``, and ``starting`` (no
    request running before the first busy read; not idle, see the module docstring)."""

    idle: int = 0
    busy: int = 0
    unanswered: int = 0
    starting: int = 0

    def see(self, running: float | None) -> None:
        """Count one read (``None``: unanswered)."""
        if running is None:
            self.unanswered += 1
        elif running > 0:
            self.busy += 1
        elif self.busy == 0:
            self.starting += 1
        else:
            self.idle += 1

    @property
    def fraction(self) -> float | None:
        """Idle reads over answered ones (``None`` before any answered)."""
        answered = self.idle + self.busy
        return round(self.idle / answered, 6) if answered else None


def _http_reader(timeout_s: float) -> Callable[[str], str | None]:
    import httpx

    client = httpx.Client(timeout=timeout_s)

    def read(url: str) -> str | None:
        try:
            answer = client.get(url.rstrip("/") + "/metrics")
        except httpx.HTTPError:
            return None
        return answer.text if answer.status_code == 200 else None

    read.close = client.close  # type: ignore[attr-defined]
    return read


class EngineIdleMeter:
    """Reads ``vllm:num_requests_running`` of every engine every ``every_s`` seconds in a thread of its own (see
    the module docstring); never raises into the run: a failed read is counted as unanswered.

    Args:
        urls: the engines' roots (``http://host:port``; an engine restarted at the same URL is read on).
        every_s: seconds between two rounds of reads.
        read: ``url -> the text of url/metrics`` or ``None`` when it does not answer (default: HTTP with a
            timeout of ``every_s`` plus a second).
    """

    def __init__(self, urls: Sequence[str], every_s: float = 0.5,
                 read: Callable[[str], str | None] | None = None) -> None:  # fmt: skip
        if not every_s > 0:
            raise ConfigError(f"every_s is {every_s}; the reads need an interval above 0 seconds", field="every_s")
        self.urls = tuple(urls)
        self.every_s = every_s
        self._read = read if read is not None else _http_reader(every_s + 1.0)
        self._counts = [IdleCounts() for _ in self.urls]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-idle", daemon=True)

    def poll(self) -> None:
        """One round: read every engine once and count what each read found."""
        for i, url in enumerate(self.urls):
            try:
                text = self._read(url)
            except Exception as exc:  # whatever the reader does, the run goes on
                logger.debug("reading %s/metrics failed: %s", url, exc)
                text = None
            running = None if text is None else running_requests(text)
            with self._lock:
                self._counts[i].see(running)

    def counts(self) -> list[IdleCounts]:
        """A copy of every engine's counts, in the order of ``urls``."""
        with self._lock:
            return [IdleCounts(c.idle, c.busy, c.unanswered, c.starting) for c in self._counts]

    def summary(self) -> dict[str, Any]:
        """The run summary's view: ``fraction`` (idle reads over answered ones, over every engine), ``per_engine``
        (each engine's), the reads per kind summed over the engines, and ``every_s``."""
        counts = self.counts()
        total = IdleCounts(*(sum(getattr(c, k) for c in counts) for k in ("idle", "busy", "unanswered", "starting")))
        return {
            "fraction": total.fraction,
            "per_engine": [c.fraction for c in counts],
            "idle_reads": total.idle,
            "busy_reads": total.busy,
            "unanswered_reads": total.unanswered,
            "starting_reads": total.starting,
            "every_s": self.every_s,
        }

    def start(self) -> EngineIdleMeter:
        """Start reading; returns ``self``."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reading (waits for a read under way, at most about ``every_s`` plus a second)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.every_s + 5.0)
        close = getattr(self._read, "close", None)
        if close is not None and not self._thread.is_alive():
            close()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()
