"""`StepThreads`: inline environments stepped, and their actions chosen, in threads of their own.

With ``StepManagerConfig(env_processes=0, step_threads=k)`` the step manager's inline environments are split into
``k`` vectors, each run here by a :class:`StepThread`: the thread steps its vector, runs the policy on what came
back, steps it again with those actions, and so on, leaving each turn's results (:class:`Made`) in a bounded
queue. The manager's caller (the rollout worker's loop) takes what every thread made in :meth:`StepThreads.take`
and does the recording (episode statistics, fragment columns, the sender's queue) meanwhile. Only stepping and
the forward pass stay on the path between two steps of an environment, so the recording overlaps the
environments' waits: for environments that wait (a socket, a sleep, a simulator that releases the GIL) the
bookkeeping of one step no longer delays the next, and with one thread per environment no environment waits for
another's step.

A thread wakes the consumer only every ``notify_every`` turns or ``notify_s`` seconds, whichever comes first, so
the consumer records in batches and the threads do not hand the interpreter lock to it on every step. Each runs
at most ``max_ahead`` turns ahead of the consumer, then waits: a worker that stops sampling (paced, waiting for
weights, stopping) holds its environments after at most that many turns.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from rollhub.inference.base import PolicyStep
from rollhub.rollout.step.env_worker import EnvWorkerError, InlineEnvWorker, VectorResult


class Made(NamedTuple):
    """One turn of a step thread: what its environments answered, and what the policy did with it."""

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
    """Steps ``worker`` with the actions of ``act`` in a daemon thread, leaving its turns for :class:`StepThreads`.

    Args:
        worker: the inline vector, already started.
        first: its first observations (as an answer with no transitions).
        act: the manager's forward pass (see :data:`Act`).
        states: the recurrent states of every instance before its first step (``None``: feed-forward).
        initial_state: the state an instance starts a new episode with (``None``: feed-forward).
        group: the group it belongs to: its lock guards ``made`` and ``error``; its ``ready`` wakes the consumer.
        name: the thread's name.
    """

    def __init__(self, worker: InlineEnvWorker, first: VectorResult, act: Act, states: np.ndarray | None,
                 initial_state: np.ndarray | None, group: StepThreads, name: str) -> None:  # fmt: skip
        self._worker = worker
        self._next = first
        self._act = act
        self._states = states
        self._initial_state = initial_state
        self._group = group
        self.made: deque[Made] = deque()  # turns not yet taken (guarded by the group's lock)
        self.error: BaseException | None = None  # what stopped the thread (guarded by the group's lock)
        self.room = threading.Condition(group.lock)  # wakes the thread when the consumer took its turns
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        group = self._group
        turns, last_wake = 0, time.monotonic()
        try:
            while not group.halted:
                made = self._turn()
                turns += 1
                with group.lock:
                    self.made.append(made)
                    now = time.monotonic()
                    if turns >= group.notify_every or now - last_wake >= group.notify_s:
                        group.ready.notify()
                        turns, last_wake = 0, now
                    while len(self.made) >= group.max_ahead and not group.halted:
                        group.ready.notify()
                        self.room.wait()
        except BaseException as exc:  # surfaces in take(), after what was made before it
            with group.lock:
                self.error = exc
                group.ready.notify()

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


class StepThreads:
    """One :class:`StepThread` per inline vector; :meth:`take` returns what they made, per vector.

    Args:
        vectors: per vector: the inline worker (started), its first answer, and its recurrent states before the
            first step (``None``: feed-forward).
        act: the manager's forward pass (see :data:`Act`), called from every thread.
        initial_state: the state an instance starts a new episode with (``None``: feed-forward).
        notify_every, notify_s: a thread wakes the consumer after this many turns or seconds since its last wake.
        max_ahead: turns a thread makes and nobody took before it waits.
    """

    def __init__(self, vectors: Sequence[tuple[InlineEnvWorker, VectorResult, np.ndarray | None]], act: Act,
                 initial_state: np.ndarray | None, *, notify_every: int = 16, notify_s: float = 0.03,
                 max_ahead: int = 64) -> None:  # fmt: skip
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)  # wakes the consumer: something was made, or an error
        self.notify_every, self.notify_s, self.max_ahead = notify_every, notify_s, max_ahead
        self.halted = False
        self.threads = [StepThread(worker, first, act, states, initial_state, self, f"rollhub-step-thread-{k}")
                        for k, (worker, first, states) in enumerate(vectors)]  # fmt: skip
        self.started = False  # the threads start in the first take

    def take(self, timeout_s: float) -> list[list[Made]]:
        """Per vector, every turn its thread made since the last call, oldest first; waits up to ``timeout_s`` for
        the first turn of any.

        Raises:
            EnvWorkerError: nothing came within ``timeout_s``, or a thread stopped on an error (once what it
                made before is taken).
        """
        if not self.started:  # the first call, after the first weights: nothing is made before them
            self.started = True
            for t in self.threads:
                t.thread.start()
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while True:
                for t in self.threads:
                    if t.error is not None and not t.made:
                        raise EnvWorkerError(f"the step thread stopped: {type(t.error).__name__}: {t.error}") \
                            from t.error  # fmt: skip
                if any(t.made for t in self.threads):
                    break
                left = deadline - time.monotonic()
                if left <= 0 or self.halted:
                    raise EnvWorkerError(f"no environment answered within {timeout_s} s (step threads); "
                                         "raise wait_timeout_s for slow environments")  # fmt: skip
                self.ready.wait(left)
            out = []
            for t in self.threads:
                out.append(list(t.made))
                t.made.clear()
                t.room.notify()  # room again, if the thread waits for it
        return out

    def close(self, timeout_s: float) -> None:
        """Stop every thread after its current step (waiting up to ``timeout_s`` in all); idempotent."""
        with self.lock:
            self.halted = True
            self.ready.notify_all()
            for t in self.threads:
                t.room.notify_all()
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            if self.started and t.thread.is_alive() and t.thread is not threading.current_thread():
                t.thread.join(max(deadline - time.monotonic(), 0.0))
