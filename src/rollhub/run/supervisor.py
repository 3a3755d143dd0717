"""`EngineSupervisor`: the engines a run started are restarted when they die, loaded with the newest weights.

The fleet restarts a dead rollout worker with the newest weights; the supervisor does the same for the vLLM
engines the run started (:class:`~rollhub.inference.engine.VLLMEngine`). A thread looks at each engine's process
every ``every_s`` seconds. When one has exited it is started again on the same port, so every client keeps its
URL, and before it serves again it is loaded with the newest version the trainer pushed
(:meth:`~rollhub.weights.engine.EngineWeightPublisher.reload`): with ``inference.push_staging``, from the staged
copy in memory when its durable checkpoint is still being written in the background, so a restart never goes
back to an older version. Meanwhile pushes skip it: a push and a reload take the same lock, so the engine comes
back with the newest version whichever came first.

Clients wait the restart out instead of failing: rollout workers' engine clients retry for
``inference.ready_timeout_s`` (``retry_for_s``) and their version subscribers keep the last version read. A
request the engine was serving when it died is sent again whole, so no group is made of samples from before and
after the death: a group half-made is never trained on.

An engine at a URL (``inference.url``) is someone else's: it is never restarted, and its death ends the run as
before. After ``max_restarts`` restarts of one engine, or a restart that fails, :meth:`check` raises
:class:`~rollhub.inference.engine.EngineDied` with the engine's log and what to do.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollhub.errors import StopRequested
from rollhub.inference.engine import EngineDied, EngineError, VLLMEngine

logger = logging.getLogger(__name__)
_DEATH_GRACE_S = 5.0  # how long a push that failed waits to see its engine's process gone


class EngineSupervisor:
    """Restarts the run's own engines when they die (see the module docstring).

    Args:
        engines: the run's engines (only :class:`VLLMEngine` ones are restarted).
        publisher: the run's weight publisher (``publish(version, weights, skip)`` and ``reload(index)``).
        max_restarts: restarts allowed per engine; 0 restarts none (a death ends the run).
        stop: asked while an engine restarts; once true, the restart is abandoned.
        every_s: seconds between two looks at the engines' processes.
    """

    def __init__(self, engines: Sequence[Any], publisher: Any, max_restarts: int,
                 stop: Callable[[], bool] | None = None, every_s: float = 1.0) -> None:  # fmt: skip
        self.engines = list(engines)
        self.publisher = publisher
        self.max_restarts = max_restarts
        self.stop = stop
        self.every_s = every_s
        self.restarts = [0] * len(self.engines)
        self.events: list[str] = []
        self.down: set[int] = set()  # engines pushes skip: dead, or being restarted
        self._restarting: set[int] = set()
        self.error: EngineError | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="engine-supervisor", daemon=True)

    @property
    def watching(self) -> bool:
        """Whether any engine can be restarted (one this run started, with ``max_restarts`` above 0)."""
        return self.max_restarts > 0 and any(isinstance(e, VLLMEngine) for e in self.engines)

    def start(self) -> None:
        """Watch the engines in a background thread until :meth:`close` (nothing to watch: no thread)."""
        if self.watching:
            self._thread.start()

    def _watch(self) -> None:
        while not self._closed.wait(self.every_s):
            self.look()

    def look(self) -> None:
        """Restart every engine of this run whose process has exited (one at a time, in this thread)."""
        for i, engine in enumerate(self.engines):
            if isinstance(engine, VLLMEngine) and i not in self._restarting and engine.process.poll() is not None:
                self._restart(i, engine)

    def _restart(self, index: int, engine: VLLMEngine) -> None:
        with self._lock:
            self.down.add(index)
            self._restarting.add(index)
        try:
            engine.check()
        except EngineDied as died:
            if self.restarts[index] >= self.max_restarts:
                self.error = EngineDied(f"{died}\nIt was restarted {self.restarts[index]} time(s), the most "
                                        "inference.max_restarts allows; find the cause in its log, or raise the "
                                        "bound")  # fmt: skip
                return
            self.restarts[index] += 1
            self._say(f"engine {index} died ({died.message.splitlines()[0]}); restarting it "
                      f"(restart {self.restarts[index]} of at most {self.max_restarts})")  # fmt: skip
        try:
            engine.restart(lambda: self._closed.is_set() or bool(self.stop and self.stop()))
            with self._lock:
                version = self.publisher.reload(index)
                self.down.discard(index)
                self._restarting.discard(index)
        except StopRequested:
            return  # the run is stopping: the engine stays down
        except EngineError as exc:
            self.error = EngineDied(f"engine {index} could not be restarted: {exc}")
            return
        self._say(f"engine {index} is back at {engine.url} with version {version}")

    def _say(self, event: str) -> None:
        self.events.append(event)
        logger.warning(event)

    def publish(self, version: int, weights: Mapping[str, Any]) -> None:
        """Push ``version`` into every engine that is up (one being restarted gets it as it comes back, and so does
        one that dies during this push)."""
        with self._lock:
            self.publisher.publish(version, weights, skip=set(self.down), lost=self._lost)

    def _lost(self, index: int) -> bool:
        """Whether engine ``index``, whose push just failed, died and will be restarted (marked down if so). Its
        process may take a moment to be seen gone after the connection broke."""
        engine = self.engines[index]
        if not (self.watching and isinstance(engine, VLLMEngine)):
            return False
        try:
            engine.process.wait(_DEATH_GRACE_S)
        except subprocess.TimeoutExpired:
            return False  # alive: the push failed for another reason
        self.down.add(index)  # the caller holds the lock
        return True

    def check(self) -> None:
        """Raise what ended supervision (restarts exhausted, a failed restart), or when an engine that is not this
        run's (at ``inference.url``), or any engine while nothing is restarted, is gone."""
        if self.error is not None:
            raise self.error
        for i, engine in enumerate(self.engines):
            if not (self.watching and isinstance(engine, VLLMEngine)) and i not in self.down:
                engine.check()

    def close(self) -> None:
        """Stop watching (the engines themselves are stopped by their owner)."""
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(60.0, self.every_s * 2))
