"""`EnvWorker`: the manager-side handle of one spawned process that steps a vector of environment instances.

The manager exchanges whole arrays with the process: one message with an action per instance, one answer with
the observations, rewards and done flags of all of them (see :mod:`rollhub.rollout.step.env_child` for the inside).
Faults stay per instance: an instance that raises is rebuilt alone inside the process and reported as
``crashed`` (the manager cuts its episode in flight as truncated: it did not reach a terminal state, it was
interrupted). If the process itself dies, this handle restarts it with exponential backoff and reports every
instance as crashed.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Literal, NamedTuple

import numpy as np

from rollhub.envs.step import EnvSpec
from rollhub.errors import ConfigError, RollhubError
from rollhub.rollout.step.env_child import (
    Backoff,
    EnvVector,
    InstanceGaveUp,
    check_timer_slack,
    child_main,
    recv_message,
    send_message,
    set_timer_slack,
)

__all__ = ["Backoff", "EnvWorker", "EnvWorkerError", "InlineEnvWorker", "StartMethod", "VectorResult",
           "check_timer_slack", "set_timer_slack"]  # fmt: skip

StartMethod = Literal["spawn", "forkserver"]
"""How environment processes start. Both start from a fresh interpreter, never by forking the (threaded)
worker: ``spawn`` runs a new interpreter per process; ``forkserver`` forks each process from one clean
server process (faster starts, and on some virtual machines markedly lower pipe wake-up latency)."""


def _context(method: StartMethod) -> Any:
    if method not in ("spawn", "forkserver"):
        raise ConfigError(f"start_method must be 'spawn' or 'forkserver', got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["rollhub.rollout.step.env_child"])
    return ctx


class EnvWorkerError(RollhubError):
    """An environment process that cannot be (re)started; the message carries the last failure."""


def _check_instances(n: int) -> None:
    if n < 1:
        raise ConfigError(f"n_instances must be >= 1, got {n}")


def _instance_seeds(seed: int | None, n: int) -> list[int | None]:
    """First-reset seeds of ``n`` instances: ``seed + i`` (all ``None`` when unseeded)."""
    return [None if seed is None else seed + i for i in range(n)]


def _one_per_instance(actions: np.ndarray, n: int) -> np.ndarray:
    """``actions`` as an array, checked to hold one action per instance (``[n, ...]``)."""
    actions = np.asarray(actions)
    if actions.shape[:1] != (n,):
        raise EnvWorkerError(f"actions: expected one per instance, shape ({n}, ...), got {actions.shape}")
    return actions


class VectorResult(NamedTuple):
    """The answer of one process to one ``step`` of its vector of ``n`` instances (a tuple: it is built on
    every turn, and a named tuple costs a fraction of a frozen dataclass).

    Attributes:
        obs: ``[n, ...]`` observations to act on next (the first observation of a new episode where an episode
            ended or an instance crashed).
        rewards: float64 ``[n]`` rewards of the transitions (0 where crashed).
        terminated: bool ``[n]``: the episode reached a terminal state.
        truncated: bool ``[n]``: the episode was cut by the environment (time limit).
        final_obs: instance -> the last observation of its episode that ended during the step (exactly the
            instances whose ``terminated`` or ``truncated`` is set).
        crashed: instance -> what failed; that instance was restarted and its episode in flight is lost.
    """

    obs: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_obs: dict[int, Any]
    crashed: dict[int, str]


class EnvWorker:
    """The manager-side handle of one environment process holding ``n_instances`` environments.

    Use: ``first_obs = start()`` (``[n, ...]``), then alternate ``send_step(actions)`` and ``recv_step()``;
    ``connection`` can be polled to find the processes with an answer ready.

    Args:
        spec: the environment recipe (built inside the process, once per instance).
        n_instances: environments in the process, stepped one after the other per message.
        seed: seed of the first reset of instance 0; instance ``i`` uses ``seed + i`` (see
            :class:`rollhub.rollout.step.env_child.EnvVector` for the seeds of restarts).
        backoff: restart delays and the failure limit (per instance inside the process, and per process here).
        start_method: how the process starts (see :data:`StartMethod`).
        timer_slack_ns: timer slack of the environment process (see :func:`set_timer_slack`; ``None``: the
            OS default).
    """

    inline = False

    def __init__(
        self,
        spec: EnvSpec,
        n_instances: int = 1,
        seed: int | None = None,
        backoff: Backoff | None = None,
        start_method: StartMethod = "spawn",
        timer_slack_ns: int | None = None,
    ) -> None:
        _check_instances(n_instances)
        self._ctx = _context(start_method)
        self.timer_slack_ns = check_timer_slack(timer_slack_ns)
        self.spec = spec
        self.n_instances = n_instances
        self.seed = seed
        self.backoff = backoff or Backoff()
        self.restarts = 0  # instance restarts, counting every instance of a restarted process
        self.process_restarts = 0
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
        seeds = _instance_seeds(self.seed, self.n_instances)
        args = (child, self.spec, seeds, self.timer_slack_ns, self.backoff, self.process_restarts)
        proc = self._ctx.Process(target=child_main, args=args, daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent

    def first_obs(self) -> np.ndarray:
        """Wait for the launched process's first observations; on failure restart with backoff."""
        try:
            return self._await_first()
        except EnvWorkerError as exc:
            self._note_failure(str(exc))
            return self.start()

    def start(self) -> np.ndarray:
        """Spawn the process and return the first observations (restarting with backoff on failure)."""
        while True:
            try:
                self.launch()
                return self._await_first()
            except EnvWorkerError as exc:
                self._note_failure(str(exc))

    def send_step(self, actions: np.ndarray) -> None:
        """Send one action per instance (``[n_instances, ...]``); a dead process is detected on the next
        :meth:`recv_step`.

        Raises:
            EnvWorkerError: ``actions`` does not hold one action per instance.
        """
        actions = _one_per_instance(actions, self.n_instances)
        try:
            send_message(self.connection, ("step", actions))
        except (BrokenPipeError, OSError):
            pass

    def recv_step(self) -> VectorResult:
        """Receive the answer to the last actions; a dead process is restarted and all its instances crashed.

        Raises:
            EnvWorkerError: an instance failed ``Backoff.max_failures`` times in a row, or the process did.
        """
        try:
            kind, payload = recv_message(self.connection)
        except (EOFError, OSError, ConnectionResetError) as exc:
            kind, payload = "error", f"environment process exited ({type(exc).__name__})"
        if kind == "step":
            self._failures = 0
            result = VectorResult(*payload)
            self.restarts += len(result.crashed)
            return result
        if kind == "fatal":
            self.close()
            raise EnvWorkerError(str(payload))
        self._note_failure(str(payload))
        obs = self.start()
        self.restarts += self.n_instances
        n = self.n_instances
        return VectorResult(obs, np.zeros(n), np.zeros(n, bool), np.zeros(n, bool), {},
                            dict.fromkeys(range(n), str(payload)))  # fmt: skip

    def close(self) -> None:
        """Stop the process (politely, then by force); idempotent."""
        if self._conn is not None:
            try:
                send_message(self._conn, ("close", None))
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

    def _await_first(self) -> np.ndarray:
        try:
            kind, payload = recv_message(self.connection)
        except (EOFError, OSError) as exc:
            raise EnvWorkerError(f"env process for {self.spec.name!r} died while starting ({exc!r})") from exc
        if kind != "obs":
            raise EnvWorkerError(f"env {self.spec.name!r} failed to start: {payload}")
        return payload

    def _note_failure(self, message: str) -> None:
        self._failures += 1
        self.process_restarts += 1
        if self._failures > self.backoff.max_failures:
            self.close()
            raise EnvWorkerError(
                f"env process of {self.spec.name!r} failed {self._failures} times in a row (last: {message}); "
                "fix the environment or raise Backoff.max_failures"
            )
        time.sleep(self.backoff.delay(self._failures))


class InlineEnvWorker:
    """:class:`EnvWorker`'s interface over instances stepped in the calling process (no process, no pipe).

    For environments so cheap that a pipe round trip costs more than the step (CartPole: about 6 µs a step):
    the manager steps them in its own thread, as a synchronous vector environment does. An instance that raises
    is rebuilt alone, as in a process; an environment that crashes the interpreter takes the rollout worker with
    it (the fleet then restarts the worker). The step runs in :meth:`recv_step`, so it counts as waiting for
    observations in the pipeline timings. The thread that builds or steps the instances gets ``timer_slack_ns``
    (see :func:`rollhub.rollout.step.env_child.set_timer_slack`), as an environment process does.
    """

    inline = True

    def __init__(self, spec: EnvSpec, n_instances: int = 1, seed: int | None = None,
                 backoff: Backoff | None = None, timer_slack_ns: int | None = None) -> None:  # fmt: skip
        _check_instances(n_instances)
        self.spec = spec
        self.n_instances = n_instances
        self.seed = seed
        self.backoff = backoff or Backoff()
        self.timer_slack_ns = check_timer_slack(timer_slack_ns)
        self.process_restarts = 0
        self._vector: EnvVector | None = None
        self._actions: np.ndarray | None = None
        self._slack_thread: int | None = None  # the thread whose slack was set last

    def _slack_here(self) -> None:
        """Give the calling thread the timer slack, once per thread (the worker's loop thread steps, another
        thread may have built the instances)."""
        thread = threading.get_ident()
        if thread != self._slack_thread:
            set_timer_slack(self.timer_slack_ns)
            self._slack_thread = thread

    @property
    def restarts(self) -> int:
        """Instance restarts so far."""
        return 0 if self._vector is None else sum(self._vector.rebuilds)

    @property
    def pid(self) -> None:
        """No process of its own."""
        return None

    def launch(self) -> None:
        """Build the instances (they reset with ``seed + i``)."""
        self.close()
        self._slack_here()
        seeds = _instance_seeds(self.seed, self.n_instances)
        try:
            self._vector = EnvVector(self.spec, seeds, self.backoff)
        except Exception as exc:
            raise EnvWorkerError(f"env {self.spec.name!r} failed to start: {type(exc).__name__}: {exc}") from exc

    def first_obs(self) -> np.ndarray:
        """The instances' first observations."""
        if self._vector is None:
            self.launch()
        assert self._vector is not None
        return self._vector.first_obs

    def start(self) -> np.ndarray:
        """Build the instances and return their first observations."""
        self.launch()
        return self.first_obs()

    def send_step(self, actions: np.ndarray) -> None:
        """Keep one action per instance for :meth:`recv_step`."""
        actions = _one_per_instance(actions, self.n_instances)
        self._actions = actions

    def recv_step(self) -> VectorResult:
        """Step every instance with the kept actions."""
        if self._vector is None or self._actions is None:
            raise EnvWorkerError("recv_step() without send_step(); start() first, then alternate")
        actions, self._actions = self._actions, None
        self._slack_here()
        try:
            return VectorResult(*self._vector.step(actions))
        except InstanceGaveUp as exc:
            raise EnvWorkerError(str(exc)) from None

    def close(self) -> None:
        """Close the instances; idempotent."""
        if self._vector is not None:
            self._vector.close()
        self._vector = None
