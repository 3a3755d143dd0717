"""The inside of an environment process: a vector of environment instances stepped on command over a pipe.

One message in (``("step", actions)``, one action per instance), one message out (the whole vector's answer),
so a manager pays one pipe round trip per vector, not per environment. An instance resets itself when its
episode ends and reports the episode's final observation. An instance that raises is closed, rebuilt alone
(after the backoff delay of its consecutive failures, reseeded) and reported as crashed; the other instances of
the process go on untouched. An instance that keeps failing past ``Backoff.max_failures`` makes the process give
up with a ``fatal`` message that names it.

Messages are pickled and framed like ``multiprocessing.connection`` (a 4-byte big-endian length), written with
one system call where they fit, so either end may use either API.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import struct
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from rollhub.envs.step import EnvSpec, close_env, make_step_env
from rollhub.errors import ConfigError

_PR_SET_TIMERSLACK = 29
_RESEED = 7919  # seed stride between rebuilds of one instance
_GENERATION = 104_729  # seed stride between restarts of the whole process


@dataclass(frozen=True)
class Backoff:
    """Restart delays: ``base_s * 2**(n-1)`` for the n-th consecutive failure, capped at ``max_s``.

    ``max_failures`` consecutive failures without a successful step (of one instance, or of a whole process)
    make the worker give up.
    """

    base_s: float = 0.05
    max_s: float = 5.0
    max_failures: int = 8

    def delay(self, consecutive_failures: int) -> float:
        """Seconds to wait before the restart after ``consecutive_failures`` failures in a row."""
        return min(self.base_s * 2 ** max(consecutive_failures - 1, 0), self.max_s)


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


_HEADER = struct.Struct("!i")


def send_message(conn: Connection, message: Any) -> None:
    """Pickle ``message`` and write it with one system call where it fits (a pipe write of up to 4 KiB is atomic).

    Plain pickle and ``os.write`` on the descriptor: per step this is the manager's and the environment's
    hot path, and Connection's ForkingPickler and buffered framing cost several microseconds more.
    """
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    fd = conn.fileno()
    while view:
        view = view[os.write(fd, view) :]


def recv_message(conn: Connection) -> Any:
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


def stack_observations(obs: list[Any]) -> np.ndarray:
    """The instances' observations as one ``[n, ...]`` array (one call for same-shaped arrays)."""
    try:
        out = np.array(obs)
    except ValueError:
        out = None
    if out is None or out.dtype == object or out.shape[0] != len(obs):
        return np.stack([np.asarray(o) for o in obs])  # raises, naming the shapes that differ
    return out


class InstanceGaveUp(Exception):
    """One instance failed ``Backoff.max_failures`` times in a row; the process cannot go on."""


class EnvVector:
    """The environment instances of one process and their per-instance restarts.

    Args:
        spec: the environment recipe.
        seeds: first-reset seed of each instance (``None``: unseeded); rebuild ``k`` of instance ``i`` resets
            with ``seeds[i] + 7919 * k``, and process restart ``g`` adds ``104729 * g``.
        backoff: delays between rebuilds of one instance, and its failure limit.
        generation: how many times the process was restarted before.
    """

    def __init__(self, spec: EnvSpec, seeds: list[int | None], backoff: Backoff, generation: int = 0) -> None:
        self.spec = spec
        self.backoff = backoff
        self._seeds = [None if s is None else s + _GENERATION * generation for s in seeds]
        self.rebuilds = [0] * len(seeds)
        self._failures = [0] * len(seeds)
        self.envs: list[Any] = []
        first = []
        for seed in self._seeds:
            env = make_step_env(spec)
            self.envs.append(env)
            first.append(env.reset(seed=seed)[0])
        self.first_obs = np.stack([np.asarray(o) for o in first])

    def step(self, actions: np.ndarray) -> tuple:
        """Step every instance with its action; the vector's answer (see :class:`VectorResult`'s fields)."""
        acts = list(actions)  # numpy scalars (or rows), as gymnasium's vector environments pass them
        n = len(self.envs)
        obs: list[Any] = [None] * n
        rewards, terminated, truncated = [0.0] * n, [False] * n, [False] * n
        final_obs: dict[int, Any] = {}
        crashed: dict[int, str] = {}
        failures = self._failures
        for i, (env, action) in enumerate(zip(self.envs, acts, strict=True)):
            try:
                o, r, te, tr, _ = env.step(action)
                if te or tr:
                    final_obs[i] = o
                    o, _ = env.reset()
                rewards[i], terminated[i], truncated[i] = r, te, tr
                if failures[i]:
                    failures[i] = 0
            except Exception as exc:
                crashed[i] = f"{type(exc).__name__}: {exc}"
                final_obs.pop(i, None)
                o = self._rebuild(i, crashed[i])
            obs[i] = o
        flags = np.array(terminated, bool), np.array(truncated, bool)
        return stack_observations(obs), np.array(rewards, np.float64), *flags, final_obs, crashed

    def _rebuild(self, i: int, error: str) -> Any:
        """Close instance ``i``, build a new one (with backoff), return its first observation."""
        try:
            close_env(self.envs[i])
        except Exception:
            pass
        while True:
            self._failures[i] += 1
            if self._failures[i] > self.backoff.max_failures:
                raise InstanceGaveUp(
                    f"instance {i} of {self.spec.name!r} failed {self._failures[i]} times in a row (last: {error}); "
                    "fix the environment or raise Backoff.max_failures"
                )
            time.sleep(self.backoff.delay(self._failures[i]))
            self.rebuilds[i] += 1
            seed = self._seeds[i]
            try:
                self.envs[i] = make_step_env(self.spec)
                return self.envs[i].reset(seed=None if seed is None else seed + _RESEED * self.rebuilds[i])[0]
            except Exception as exc:
                error = f"rebuild failed: {type(exc).__name__}: {exc}"

    def close(self) -> None:
        """Close every instance, ignoring their errors."""
        for env in self.envs:
            try:
                close_env(env)
            except Exception:
                pass


def child_main(
    conn: Connection,
    spec: EnvSpec,
    seeds: list[int | None],
    timer_slack_ns: int | None,
    backoff: Backoff,
    generation: int,
) -> None:
    """The loop of an environment process: first observations out, then ``("step", actions)`` in and one answer
    out, until ``close``. A failure to start is reported as ``error``; an instance that gave up as ``fatal``."""
    vector: EnvVector | None = None
    try:
        set_timer_slack(timer_slack_ns)
        vector = EnvVector(spec, seeds, backoff, generation)
        send_message(conn, ("obs", vector.first_obs))
        while True:
            cmd, arg = recv_message(conn)
            if cmd == "close":
                break
            send_message(conn, ("step", vector.step(arg)))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass
    except InstanceGaveUp as exc:
        _report(conn, "fatal", str(exc))
    except BaseException as exc:  # report anything the environment raised, then exit
        _report(conn, "error", f"{type(exc).__name__}: {exc}")
    finally:
        if vector is not None:
            vector.close()


def _report(conn: Connection, kind: str, message: str) -> None:
    try:
        send_message(conn, (kind, message))
    except (BrokenPipeError, OSError):
        pass
