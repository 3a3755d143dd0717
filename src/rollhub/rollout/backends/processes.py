"""`ProcessFleet`: the rollout fleet without Ray on one machine, one process per RolloutWorker.

The local fleet's supervision, buffer and statistics, with each :class:`RolloutWorker` in a process of its own
(started with ``spawn``), so workers stepping microsecond environments in their own thread use every core instead
of sharing the trainer's GIL. A worker process talks to the fleet over two pipes:

* the *control* pipe: weights and ``stop`` go to the worker, its ``info`` snapshots (on request) and finished
  episodes come back;
* the *write* pipe: the worker's sender thread sends each list of items and waits for the answer of the fleet's
  writer (``ok``, a partial write to retry, or an error), so the buffer's back-pressure reaches the worker exactly
  as it does in process: a full buffer holds the sender, which holds the sampling loop.

A worker process that dies, or whose loop fails, is replaced with the newest weights like a failed worker thread;
one that loses its fleet (the control pipe closes) stops by itself, with its environment processes.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from rollhub.errors import QueueFull, RollhubError
from rollhub.rollout.backends.local import LocalFleet
from rollhub.rollout.protocols import RolloutManager
from rollhub.rollout.replay import PartialWrite
from rollhub.rollout.worker import RolloutWorker, RolloutWorkerConfig, WorkerState
from rollhub.weights.base import WeightUpdate


class WorkerProcessError(RollhubError):
    """A worker process failed to start or stopped answering; the message says why."""


# ---- the worker process's side ---------------------------------------------------------------------------


class PipeWriter:
    """The worker's writer inside its process: each ``write`` goes over the write pipe and waits for the
    fleet's answer, raising :class:`~rollhub.rollout.replay.PartialWrite` when the buffer took only part."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def write(self, items: list[Any]) -> None:
        """Send ``items`` and wait until the fleet's writer took them (or said why not)."""
        self.conn.send_bytes(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL))
        answer = self.conn.recv()
        if answer[0] == "full":
            _, message, retry_after_s, accepted = answer
            raise PartialWrite(message, retry_after_s=retry_after_s, accepted=accepted)
        if answer[0] == "error":
            raise WorkerProcessError(f"the fleet's writer refused the items: {answer[1]}")

    def close(self) -> None:
        """Close the write pipe (the fleet's side sees the end and stops serving it)."""
        self.conn.close()


class _Outbox:
    """The control pipe's sending side in the worker process, shared by its threads."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self.lock:
            self.conn.send(message)

    def record(self, episodes: list[Any], worker_id: str = "") -> None:
        """The worker's ``statistics``: finished episodes go to the fleet's statistics."""
        self.send(("episodes", episodes, worker_id))


def _worker_main(ctrl: Connection, sink: Connection, worker_id: str,
                 manager_factory: Callable[[str], RolloutManager], config: RolloutWorkerConfig) -> None:  # fmt: skip
    """A worker process: build the worker (or report why not), then serve the control pipe until ``stop`` or
    until the fleet is gone; stop the worker (its sender drains first) and report its final ``info``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the fleet stops its workers
    outbox = _Outbox(ctrl)
    try:
        worker = RolloutWorker(worker_id, manager_factory, PipeWriter(sink), config, outbox)
    except BaseException as exc:
        outbox.send(("error", _portable(exc)))
        return
    outbox.send(("ready",))
    worker.start()
    try:
        while True:
            message = ctrl.recv()
            if message[0] == "weights":
                worker.offer_weights(message[1], WeightUpdate(message[1], message[2]))
            elif message[0] == "info":
                outbox.send(("info", message[1], worker.info()))
            elif message[0] == "stop":
                break
    except (EOFError, OSError):  # the fleet is gone: stop anyway
        pass
    worker.stop()
    try:
        outbox.send(("final", worker.info()))
    except OSError:
        pass


def _portable(exc: BaseException) -> BaseException:
    """``exc`` when it survives pickling, else a :class:`WorkerProcessError` with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return WorkerProcessError(f"{type(exc).__name__}: {exc}")


# ---- the fleet's side ------------------------------------------------------------------------------------


class WorkerProcess:
    """A :class:`RolloutWorker` in its own process, with the surface :class:`LocalFleet` supervises
    (``start``, ``offer_weights``, ``state``, ``error``, ``info``, ``stop``).

    Args:
        worker_id, manager_factory, writer, config, statistics: as for :class:`RolloutWorker`; ``writer`` and
            ``statistics`` stay in this process and serve the worker's pipes.
        start_timeout_s: how long the worker may take to build its manager.

    Raises:
        Exception: what ``manager_factory`` raised in the worker process (or a :class:`WorkerProcessError`
            with its text), or a :class:`WorkerProcessError` when the process died or did not answer in time.
    """

    def __init__(
        self,
        worker_id: str,
        manager_factory: Callable[[str], RolloutManager],
        writer: Any,
        config: RolloutWorkerConfig,
        statistics: Any = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        self.writer = writer
        self.statistics = statistics
        self._ctrl, child_ctrl = multiprocessing.Pipe()
        self._sink, child_sink = multiprocessing.Pipe()
        self._send_lock = threading.Lock()
        self._answers: dict[int, dict[str, Any]] = {}
        self._asked = 0
        self._changed = threading.Condition()
        self._last: dict[str, Any] = {"worker_id": worker_id, "state": WorkerState.WAITING_FOR_WEIGHTS.value}
        self._final: dict[str, Any] | None = None
        self._gone = False
        self._stopping = False
        self._threads: list[threading.Thread] = []  # serving the pipes, once the worker is ready
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(target=_worker_main, name=f"rollout-worker-{worker_id}",
                                       args=(child_ctrl, child_sink, worker_id, manager_factory, config))  # fmt: skip
        self.process.start()
        child_ctrl.close()
        child_sink.close()
        try:
            self._await_ready(start_timeout_s)
        except BaseException:
            self._end_process()
            raise
        self._threads += [
            threading.Thread(target=self._read_control, name=f"fleet-control-{worker_id}", daemon=True),
            threading.Thread(target=self._serve_writes, name=f"fleet-writes-{worker_id}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _await_ready(self, timeout_s: float) -> None:
        if not self._ctrl.poll(timeout_s):
            raise WorkerProcessError(f"worker {self.worker_id} did not start within {timeout_s} s")
        try:
            answer = self._ctrl.recv()
        except (EOFError, OSError):
            self.process.join(timeout=5.0)
            raise WorkerProcessError(
                f"worker {self.worker_id}'s process exited while starting (exit code {self.process.exitcode})"
            ) from None
        if answer[0] == "error":
            raise answer[1]

    # ---- the surface LocalFleet uses ---------------------------------------------------------------
    def start(self) -> None:
        """Nothing to do: the worker started sampling as soon as its process had built it."""

    def offer_weights(self, version: int, update: WeightUpdate) -> None:
        """Send ``update``'s weights to the worker (it loads them between two inference batches). A worker whose
        process is gone gets nothing: its state says ``failed`` and the fleet's supervision replaces it, handing the
        replacement the newest weights."""
        weights: Mapping[str, np.ndarray] = update.weights
        try:
            self._send(("weights", version, dict(weights)))
        except OSError:
            pass

    @property
    def state(self) -> WorkerState:
        """The worker's state; ``FAILED`` once its process is gone without being stopped."""
        return WorkerState(self.info()["state"])

    @property
    def error(self) -> str:
        """Why the worker failed (empty while it has not)."""
        return str(self.info().get("error", ""))

    def info(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """A fresh snapshot of the worker's ``info`` (its last one once it stopped or its process died)."""
        if self._final is not None or self._gone:
            return self._ended_info()
        with self._changed:
            self._asked += 1
            ask = self._asked
        try:
            self._send(("info", ask))
        except OSError:
            return self._ended_info()
        with self._changed:
            self._changed.wait_for(lambda: ask in self._answers or self._gone, timeout=timeout_s)
            answer = self._answers.pop(ask, None)
        if answer is None:
            return self._ended_info() if self._gone else {**self._last, "stale_s": timeout_s}
        self._last = answer
        return answer

    def stop(self) -> None:
        """Ask the worker to stop (its sender drains first, up to ``drain_s``), wait for its last ``info``, end
        the process; idempotent."""
        if not self._stopping:
            self._stopping = True
            try:
                self._send(("stop",))
            except OSError:
                pass
            with self._changed:
                self._changed.wait_for(lambda: self._final is not None or self._gone,
                                       timeout=30.0 + self.config.drain_s)  # fmt: skip
        self._end_process()

    # ---- internals ----------------------------------------------------------------------------------
    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._ctrl.send(message)

    def _ended_info(self) -> dict[str, Any]:
        if self._final is not None:
            return self._final
        code = self.process.exitcode
        if self._stopping:
            return {**self._last, "state": WorkerState.STOPPED.value}
        return {**self._last, "state": WorkerState.FAILED.value,
                "error": f"worker process {self.process.pid} exited (exit code {code})"}  # fmt: skip

    def _read_control(self) -> None:
        """Info answers, episodes and the final info from the worker; the end of the pipe means it is gone."""
        try:
            while True:
                message = self._ctrl.recv()
                if message[0] == "episodes" and self.statistics is not None:
                    self.statistics.record(message[1], message[2])
                elif message[0] in ("info", "final"):
                    with self._changed:
                        if message[0] == "info":
                            self._answers[message[1]] = message[2]
                        else:
                            self._final = message[1]
                        self._changed.notify_all()
        except (EOFError, OSError):
            pass
        self.process.join(timeout=5.0)
        with self._changed:
            self._gone = True
            self._changed.notify_all()

    def _serve_writes(self) -> None:
        """Write each list of items the worker sends and answer how it went."""
        try:
            while True:
                items = pickle.loads(self._sink.recv_bytes())
                self._sink.send(self._write(items))
        except (EOFError, OSError):
            pass

    def _write(self, items: list[Any]) -> tuple[Any, ...]:
        try:
            self.writer.write(items)
        except QueueFull as exc:
            return ("full", str(exc), exc.retry_after_s, exc.accepted)
        except Exception as exc:
            return ("error", f"{type(exc).__name__}: {exc}")
        return ("ok",)

    def _end_process(self) -> None:
        """Wait for the process to end (terminate, then kill it if it does not), then for the threads serving
        its pipes, which see the pipes' ends; close this side."""
        self.process.join(timeout=10.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        deadline = time.monotonic() + 5.0
        for thread in self._threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        self._ctrl.close()
        self._sink.close()


class ProcessFleet(LocalFleet):
    """``n_workers`` RolloutWorker processes on this machine, supervised as :class:`LocalFleet`'s threads are,
    writing into a buffer of this process; the surface of :class:`FleetClient`.

    Args: as :class:`LocalFleet`'s. ``manager_factory`` must pickle (it is called in the worker process).
    """

    def _new_worker(self, worker_id: str) -> Any:
        return WorkerProcess(worker_id, self.manager_factory, self.writer, self.config.worker, self.stats)
