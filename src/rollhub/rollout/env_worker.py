"""`EnvWorker`: one spawned process that owns one step environment and talks to its manager over a pipe.

The child process resets the environment by itself when an episode ends and sends both the final observation
and the first observation of the next episode. If the environment raises, or the process dies, the parent
side restarts the process with exponential backoff and reports the step as ``crashed``: the manager then cuts
the episode in flight as truncated (the environment did not reach a terminal state, it was interrupted).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import struct
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

import numpy as np

from rollhub.envs.step import EnvSpec, make_step_env
from rollhub.errors import ConfigError, RollhubError

StartMethod = Literal["spawn", "forkserver"]
"""How environment processes start. Both start from a fresh interpreter, never by forking the (threaded)
worker: ``spawn`` runs a new interpreter per environment; ``forkserver`` forks each environment from one clean
server process (faster starts, and on some virtual machines markedly lower pipe wake-up latency)."""


def _context(method: StartMethod) -> Any:
    if method not in ("spawn", "forkserver"):
        raise ConfigError(f"start_method must be 'spawn' or 'forkserver', got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["rollhub.rollout.env_worker"])
    return ctx


_PR_SET_TIMERSLACK = 29


def check_timer_slack(ns: int | None) -> int | None:
    """``ns`` when it is a valid timer slack (``None`` or at least 1 ns), else :class:`ConfigError`."""
    if ns is not None and ns < 1:
        raise ConfigError(f"timer_slack_ns must be >= 1 or None, got {ns}")
    return ns


def set_timer_slack(ns: int | None) -> bool:
    """Set the calling thread's timer slack to ``ns`` nanoseconds (Linux; ``None`` keeps the OS default).

    Linux lets a normal thread's timed sleeps and timeouts fire up to 50 µs late so it can batch wake-ups;
    an environment that waits on a timer (a rate-limited simulator, a control loop, the ``sleep`` env) then
    runs that much slower than it asks. Environment processes set a small slack before they build the
    environment. Returns whether the setting was applied.
    """
    if check_timer_slack(ns) is None or sys.platform != "linux":
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class EnvWorkerError(RollhubError):
    """An environment process that cannot be (re)started; the message carries the last failure."""


@dataclass(frozen=True)
class Backoff:
    """Restart delays: ``base_s * 2**(n-1)`` for the n-th consecutive failure, capped at ``max_s``.

    ``max_failures`` consecutive failures without a successful step make the worker give up.
    """

    base_s: float = 0.05
    max_s: float = 5.0
    max_failures: int = 8

    def delay(self, consecutive_failures: int) -> float:
        """Seconds to wait before the restart after ``consecutive_failures`` failures in a row."""
        return min(self.base_s * 2 ** max(consecutive_failures - 1, 0), self.max_s)


@dataclass(frozen=True)
class EnvResult:
    """The answer to one ``step``.

    Attributes:
        obs: the observation to act on next (the first observation of a new episode after a done or a crash).
        reward: reward of the transition (0 when ``crashed``).
        terminated: the episode reached a terminal state.
        truncated: the episode was cut by the environment (time limit).
        final_obs: the last observation of the episode that ended (``None`` unless terminated or truncated).
        crashed: the environment failed during the step and was restarted; the episode in flight is lost.
        error: what failed, when ``crashed``.
    """

    obs: Any
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    final_obs: Any = None
    crashed: bool = False
    error: str = ""


_HEADER = struct.Struct("!i")  # the framing of Connection.send_bytes, so either end may use either API


def _send(conn: Connection, message: Any) -> None:
    """Pickle ``message`` and write it with one system call where it fits (a pipe write of up to 4 KiB is atomic).

    Plain pickle and ``os.write`` on the descriptor: per step this is the manager's and the environment's
    hot path, and Connection's ForkingPickler and buffered framing cost several microseconds more.
    """
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    fd = conn.fileno()
    while view:
        view = view[os.write(fd, view) :]


def _recv(conn: Connection) -> Any:
    """Read one framed message; the two ends alternate strictly, so a read never takes the next message."""
    fd = conn.fileno()
    data = os.read(fd, 65536)
    while len(data) < 4:
        if not data or not (more := os.read(fd, 4 - len(data))):
            raise EOFError("the other end of the pipe is closed")
        data += more
    end = 4 + _HEADER.unpack_from(data)[0]
    if len(data) < end:
        parts = [data]
        have = len(data)
        while have < end:
            more = os.read(fd, min(end - have, 1 << 20))
            if not more:
                raise EOFError("the other end of the pipe closed mid-message")
            parts.append(more)
            have += len(more)
        data = b"".join(parts)
    return pickle.loads(memoryview(data)[4:end])


def _child_main(conn: Connection, spec: EnvSpec, seed: int | None, timer_slack_ns: int | None = None) -> None:
    """The loop of the environment process: ``("step", action)`` in, one message out, until ``close``."""
    try:
        set_timer_slack(timer_slack_ns)
        env = make_step_env(spec)
        obs, _ = env.reset(seed=seed)
        _send(conn, ("obs", obs))
        while True:
            cmd, arg = _recv(conn)
            if cmd == "close":
                break
            obs, reward, terminated, truncated, _ = env.step(arg)
            final_obs = None
            if terminated or truncated:
                final_obs = obs
                obs, _ = env.reset()
            _send(conn, ("step", (obs, float(reward), bool(terminated), bool(truncated), final_obs)))
        env.close()
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass
    except BaseException as exc:  # report anything the environment raised, then exit
        try:
            _send(conn, ("error", f"{type(exc).__name__}: {exc}"))
        except (BrokenPipeError, OSError):
            pass


class EnvWorker:
    """The manager-side handle of one environment process.

    Use: ``first_obs = start()``, then alternate ``send_step(action)`` and ``recv_step()``; ``connection``
    can be passed to ``multiprocessing.connection.wait`` to find the workers with an answer ready.

    Args:
        spec: the environment recipe (built inside the child).
        seed: seed of the first reset; restart ``k`` resets with ``seed + 7919 * k``.
        backoff: restart delays and the failure limit.
        start_method: how the process starts (see :data:`StartMethod`).
        timer_slack_ns: timer slack of the environment process (see :func:`set_timer_slack`; ``None``: the
            OS default).
    """

    def __init__(
        self,
        spec: EnvSpec,
        seed: int | None = None,
        backoff: Backoff | None = None,
        start_method: StartMethod = "spawn",
        timer_slack_ns: int | None = None,
    ) -> None:
        self._ctx = _context(start_method)
        self.timer_slack_ns = check_timer_slack(timer_slack_ns)
        self.spec = spec
        self.seed = seed
        self.backoff = backoff or Backoff()
        self.restarts = 0
        self._failures = 0
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None

    @property
    def connection(self) -> Connection:
        """The parent end of the pipe (valid after :meth:`start`)."""
        if self._conn is None:
            raise EnvWorkerError(f"EnvWorker for {self.spec.name!r} is not started; call start() first")
        return self._conn

    @property
    def pid(self) -> int | None:
        """The environment process id, or ``None`` when not running."""
        return self._proc.pid if self._proc is not None else None

    def launch(self) -> None:
        """Spawn the process without waiting for it (see :meth:`first_obs`); lets many start in parallel."""
        self.close()
        parent, child = self._ctx.Pipe()
        seed = None if self.seed is None else self.seed + 7919 * self.restarts
        proc = self._ctx.Process(target=_child_main, args=(child, self.spec, seed, self.timer_slack_ns), daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent

    def first_obs(self) -> Any:
        """Wait for the launched process's first observation; on failure restart with backoff."""
        try:
            return self._await_first()
        except EnvWorkerError as exc:
            self._note_failure(str(exc))
            return self.start()

    def start(self) -> Any:
        """Spawn the process and return the first observation (restarting with backoff on failure)."""
        while True:
            try:
                self.launch()
                return self._await_first()
            except EnvWorkerError as exc:
                self._note_failure(str(exc))

    def send_step(self, action: Any) -> None:
        """Send ``action``; a dead process is detected on the next :meth:`recv_step`."""
        if isinstance(action, np.generic):
            action = action.item()  # a Python scalar pickles several times faster than a numpy one
        try:
            _send(self.connection, ("step", action))
        except (BrokenPipeError, OSError):
            pass

    def recv_step(self) -> EnvResult:
        """Receive the answer to the last action; on failure restart and return a ``crashed`` result."""
        try:
            kind, payload = _recv(self.connection)
        except (EOFError, OSError, ConnectionResetError) as exc:
            kind, payload = "error", f"environment process exited ({type(exc).__name__})"
        if kind == "step":
            self._failures = 0
            obs, reward, terminated, truncated, final_obs = payload
            return EnvResult(obs, reward, terminated, truncated, final_obs)
        self._note_failure(str(payload))
        return EnvResult(obs=self.start(), crashed=True, error=str(payload))

    def close(self) -> None:
        """Stop the process (politely, then by force); idempotent."""
        if self._conn is not None:
            try:
                _send(self._conn, ("close", None))
            except (BrokenPipeError, OSError):
                pass
        if self._proc is not None:
            self._proc.join(timeout=1.0)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=1.0)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def _await_first(self) -> Any:
        try:
            kind, payload = _recv(self.connection)
        except (EOFError, OSError) as exc:
            raise EnvWorkerError(f"env process for {self.spec.name!r} died while starting ({exc!r})") from exc
        if kind != "obs":
            raise EnvWorkerError(f"env {self.spec.name!r} failed to reset: {payload}")
        return payload

    def _note_failure(self, message: str) -> None:
        self._failures += 1
        self.restarts += 1
        if self._failures > self.backoff.max_failures:
            self.close()
            raise EnvWorkerError(
                f"env {self.spec.name!r} failed {self._failures} times in a row (last: {message}); "
                "fix the environment or raise Backoff.max_failures"
            )
        time.sleep(self.backoff.delay(self._failures))
