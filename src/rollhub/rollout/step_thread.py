"""`StepThread`: inline environments stepped, and their actions chosen, in a thread of their own.

With ``StepManagerConfig(env_processes=0, step_thread=True)`` the step manager's inline vector runs here: the
thread steps it, runs the policy on what came back, steps it again with those actions, and so on, leaving each
turn's results (:class:`Made`) in a bounded queue. The manager's caller (the rollout worker's loop) takes them
in :meth:`StepThread.take` and does the recording (episode statistics, fragment columns, the sender's queue)
meanwhile. Only stepping and the forward pass stay on the path between two steps of an environment, so the
recording overlaps the environments' waits: for an environment that waits (a socket, a sleep, a simulator that
releases the GIL) the bookkeeping of one step no longer delays the next.

The thread wakes its consumer only every ``notify_every`` turns or ``notify_s`` seconds, whichever comes first,
so the consumer records in batches and the two threads do not hand the interpreter lock back and forth on every
step. It runs at most ``max_ahead`` turns ahead of the consumer, then waits: a worker that stops sampling (paced,
waiting for weights, stopping) holds its environments after at most that many turns.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from rollhub.rollout.env_worker import EnvWorkerError, InlineEnvWorker, VectorResult
from rollhub.rollout.protocols import PolicyStep


class Made(NamedTuple):
    """One turn of the step thread: what the environments answered, and what the policy did with it."""

    arrival: VectorResult
    out: PolicyStep
    states: np.ndarray | None  # the recurrent states the policy was given (``None``: feed-forward)
    final_values: np.ndarray | float  # value estimates of the truncated episodes' final observations
    generation: int  # the manager's weight generation that chose the actions
    step_s: float  # seconds stepping the environments
    act_s: float  # seconds in the policy


Act = Callable[[VectorResult, "np.ndarray | None"], tuple[PolicyStep, "np.ndarray | float", int]]
"""The manager's forward pass on one arrival and the states before it: actions, final values, generation."""


class StepThread:
    """Steps ``worker`` with the actions of ``act`` in a daemon thread; :meth:`take` returns what it made.

    Args:
        worker: the inline vector, already started.
        first: its first observations (as an answer with no transitions).
        act: the manager's forward pass (see :data:`Act`).
        states: the recurrent states of every instance before its first step (``None``: feed-forward).
        initial_state: the state an instance starts a new episode with (``None``: feed-forward).
        notify_every, notify_s: wake the consumer after this many turns or seconds since the last wake.
        max_ahead: turns made and not yet taken before the thread waits.
    """

    def __init__(self, worker: InlineEnvWorker, first: VectorResult, act: Act, states: np.ndarray | None,
                 initial_state: np.ndarray | None, *, notify_every: int = 16, notify_s: float = 0.03,
                 max_ahead: int = 64) -> None:  # fmt: skip
        self._worker = worker
        self._next = first
        self._act = act
        self._states = states
        self._initial_state = initial_state
        self._notify_every = notify_every
        self._notify_s = notify_s
        self._max_ahead = max_ahead
        self._made: deque[Made] = deque()
        self._cond = threading.Condition()
        self._halt = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollhub-step-thread", daemon=True)
        self._started = False

    def take(self, timeout_s: float) -> list[Made]:
        """Every turn made since the last call, oldest first; waits up to ``timeout_s`` for the first.

        Raises:
            EnvWorkerError: nothing came within ``timeout_s``, or the thread stopped on an error (once what it
                made before is taken).
        """
        if not self._started:  # the first call, after the first weights: nothing is made before them
            self._started = True
            self._thread.start()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._made:
                if self._error is not None:
                    raise EnvWorkerError(f"the step thread stopped: {type(self._error).__name__}: {self._error}") \
                        from self._error  # fmt: skip
                left = deadline - time.monotonic()
                if left <= 0 or self._halt:
                    raise EnvWorkerError(f"no environment answered within {timeout_s} s (step thread); "
                                         "raise wait_timeout_s for slow environments")  # fmt: skip
                self._cond.wait(left)
            made = list(self._made)
            self._made.clear()
            self._cond.notify()  # room again, if the thread waits for it
        return made

    def close(self, timeout_s: float) -> None:
        """Stop the thread after its current step (waiting up to ``timeout_s``); idempotent."""
        with self._cond:
            self._halt = True
            self._cond.notify_all()
        if self._started and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        turns, last_wake = 0, time.monotonic()
        try:
            while not self._halt:
                made = self._turn()
                turns += 1
                with self._cond:
                    self._made.append(made)
                    now = time.monotonic()
                    if turns >= self._notify_every or now - last_wake >= self._notify_s:
                        self._cond.notify()
                        turns, last_wake = 0, now
                    while len(self._made) >= self._max_ahead and not self._halt:
                        self._cond.notify()
                        self._cond.wait()
        except BaseException as exc:  # surfaces in take(), after what was made before it
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _turn(self) -> Made:
        """Act on the last answer, step with the actions, keep the next answer; what the policy did."""
        arrival = self._next
        states = self._states
        if states is not None:  # an instance whose episode ended (or crashed) starts its new one afresh
            for j in [*arrival.final_obs, *arrival.crashed]:
                states[j] = self._initial_state
        t0 = time.perf_counter()
        out, final_values, generation = self._act(arrival, states)
        t1 = time.perf_counter()
        self._worker.send_step(out.actions)
        self._next = self._worker.recv_step()
        t2 = time.perf_counter()
        if out.state is not None:
            self._states = np.array(out.state, copy=True)
        return Made(arrival, out, states, final_values, generation, t2 - t1, t1 - t0)
