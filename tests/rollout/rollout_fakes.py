"""Scripted environments and policies for the rollout tests (importable by spawned EnvWorker processes)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rollhub.inference.base import PolicyStep


def timer_slack_ns() -> int:
    """The calling thread's timer slack (Linux ``prctl(PR_GET_TIMERSLACK)``)."""
    assert sys.platform == "linux"
    return int(ctypes.CDLL(None).prctl(30, 0, 0, 0, 0))


class BigObsEnv:
    """Observations of ``size`` int64 values (``t`` everywhere at step ``t``): far larger than a pipe's buffer."""

    def __init__(self, size: int = 100_000) -> None:
        self.size, self.t = size, 0

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        self.t = 0
        return np.zeros(self.size, dtype=np.int64), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return np.full(self.size, self.t, dtype=np.int64), float(action), False, False, {}

    def close(self) -> None:
        pass


class ActionTypeEnv:
    """Observes how its last action arrived: ``[1 if a numpy integer else 0, action]``."""

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        return np.zeros(2, dtype=np.int64), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.array([isinstance(action, np.integer), action], dtype=np.int64), 0.0, False, False, {}

    def close(self) -> None:
        pass


class SlackEnv:
    """Observes the timer slack its own process runs with (every observation is ``[slack_ns, 0]``)."""

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        return np.array([timer_slack_ns(), 0], dtype=np.int64), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.array([timer_slack_ns(), 0], dtype=np.int64), 0.0, False, False, {}

    def close(self) -> None:
        pass


class CountingEnv:
    """Observation ``[episode, t]``; the step from ``t`` earns reward ``t + 1``; episodes last ``length`` steps.

    ``end="terminate"`` ends episodes as terminated, ``"truncate"`` as truncated. With ``raise_at`` the
    process raises on its ``raise_at``-th step (counted per process, so a restarted process raises again).
    With ``mark_seed`` every reward adds ``1000 * (first seed % 7919)``: the instance's index, the same after a
    rebuild, so episode returns tell the instances apart.
    """

    def __init__(self, length: int = 5, end: str = "terminate", raise_at: int | None = None,
                 mark_seed: bool = False) -> None:  # fmt: skip
        self.length, self.end, self.raise_at, self.mark_seed = length, end, raise_at, mark_seed
        self.episode, self.t, self.steps, self.offset = -1, 0, 0, None

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        if self.offset is None:
            self.offset = 1000.0 * (seed % 7919) if self.mark_seed and seed is not None else 0.0
        self.episode += 1
        self.t = 0
        return np.array([self.episode, 0], dtype=np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        if self.raise_at is not None and self.steps == self.raise_at:
            raise RuntimeError("scripted failure")
        reward = float(self.t + 1) + self.offset
        self.t += 1
        done = self.t >= self.length
        obs = np.array([self.episode, self.t], dtype=np.float32)
        return obs, reward, done and self.end == "terminate", done and self.end == "truncate", {}

    def close(self) -> None:
        pass


class ValuePolicy:
    """Deterministic policy: action 0, log-prob -0.5, value = ``10 * episode + t`` (readable in fragments)."""

    def __init__(self) -> None:
        self.loaded: list[dict[str, np.ndarray]] = []

    def act(self, obs: np.ndarray, state: np.ndarray | None) -> PolicyStep:
        n = obs.shape[0]
        return PolicyStep(np.zeros(n, dtype=np.int64), np.full(n, -0.5, np.float32), self.value(obs), None)

    def value(self, obs: np.ndarray) -> np.ndarray:
        return (10 * obs[:, 0] + obs[:, 1]).astype(np.float32)

    def initial_state(self) -> None:
        return None

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        self.loaded.append(dict(weights))


class WeightEchoPolicy:
    """Logs the weights it runs with: every step's log-prob is ``-weights["v"]`` of the loaded weights."""

    def __init__(self) -> None:
        self.v = float("nan")

    def act(self, obs: np.ndarray, state: np.ndarray | None) -> PolicyStep:
        n = obs.shape[0]
        return PolicyStep(np.zeros(n, dtype=np.int64), np.full(n, -self.v, np.float32), np.zeros(n, np.float32))

    def value(self, obs: np.ndarray) -> np.ndarray:
        return np.zeros(obs.shape[0], np.float32)

    def initial_state(self) -> None:
        return None

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        self.v = float(weights["v"])


class Collector:
    """A stand-in replay buffer (run as a Ray actor): keeps every item added."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def add(self, items: list[Any]) -> int:
        self.items.extend(items)
        return len(items)

    def take(self) -> list[Any]:
        out, self.items = self.items, []
        return out


class StepCounterPolicy(ValuePolicy):
    """A 'recurrent' policy whose state counts the steps it has taken in the current episode."""

    def act(self, obs: np.ndarray, state: np.ndarray | None) -> PolicyStep:
        step = super().act(obs, state)
        assert state is not None
        return PolicyStep(step.actions, step.logp, step.values, state + 1)

    def initial_state(self) -> np.ndarray:
        return np.zeros(1, np.float32)


class GateEnv:
    """Observation ``[seed, t]`` (``t`` counts the instance's steps); the reward of a step is ``t`` after it.

    Instances whose first reset seed is in ``gated`` block in ``step`` until the file ``gate`` exists (a
    straggler that is released on command); ``raise_at`` makes the instance with seed ``raise_seed`` raise on
    its ``raise_at``-th step (counted per instance, so a rebuilt instance starts counting again).
    """

    def __init__(self, gate: str = "", gated: tuple[int, ...] = (), raise_seed: int = -1, raise_at: int = 0) -> None:
        self.gate, self.gated = gate, tuple(gated)
        self.raise_seed, self.raise_at = raise_seed, raise_at
        self.seed, self.t, self.steps = -1, 0, 0

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None and self.seed == -1:
            self.seed = seed
        self.t = 0
        return np.array([self.seed, 0], dtype=np.int64), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        while self.seed in self.gated and not os.path.exists(self.gate):
            time.sleep(0.005)
        self.steps += 1
        if self.seed == self.raise_seed and self.steps == self.raise_at:
            raise RuntimeError(f"scripted failure of seed {self.seed}")
        self.t += 1
        return np.array([self.seed, self.t], dtype=np.int64), float(self.t), False, False, {}

    def close(self) -> None:
        pass


class FileFailingManager:
    """A step manager that fails its ``sample_batch`` while the count in ``budget`` (a file, shared by every
    instance in every process) is above 0, counting it down; ``fail_at_start`` fails the constructor instead."""

    def __init__(self, budget: str, fail_at_start: bool, worker_id: str) -> None:
        if fail_at_start:
            raise OSError(f"cannot open the simulator for {worker_id}")
        self.budget, self.worker_id = budget, worker_id

    def update_model(self, weights: Mapping[str, np.ndarray]) -> None:
        pass

    def sample_batch(self, request: Any) -> Any:
        from rollhub.rollout.protocols import SampleResult

        with open(self.budget) as f:
            left = int(f.read() or 0)
        if left > 0:
            with open(self.budget, "w") as f:
                f.write(str(left - 1))
            raise RuntimeError("simulator lost")
        time.sleep(0.001)
        return SampleResult(items=[], env_steps=1, timings={})

    def shutdown(self) -> None:
        pass


def session_members(sid: int) -> list[int]:
    """Pids of the processes in session ``sid`` (``/proc``): what a scenario started as a session leader left
    running, wherever Ray renamed them or gave them process groups of their own."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, session, ...
        if int(fields[3]) == sid:
            pids.append(int(entry.name))
    return pids


def wait_until(condition: Any, what: str, timeout_s: float = 180.0) -> None:
    """Poll ``condition()`` until it holds; fail naming ``what`` after ``timeout_s`` (generous: busy machines)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def echo_weights(version: int) -> dict[str, np.ndarray]:
    """Weights for :class:`WeightEchoPolicy` that make every log-prob ``-version``."""
    return {"v": np.array(float(version))}


def drain_replay(replay: Any) -> list[Any]:
    """Every item a local ``ReplayBuffer`` holds now, batch by batch."""
    out = []
    while (batch := replay.next_batch(0.0)) is not None:
        out += batch.items
    return out


def check_versions_as_loaded(items: list[Any]) -> None:
    """Every step of ``items`` (fragments made with :class:`WeightEchoPolicy`) carries the version of the weights
    it ran with, and versions never go back within an environment."""
    for fragment in items:  # the echo policy's log-prob is minus the version of the weights it ran with
        np.testing.assert_array_equal(-fragment.logp, fragment.versions.astype(np.float32))
    by_env: dict[tuple[str, int], list[int]] = {}
    for fragment in items:
        by_env.setdefault((fragment.worker_id, fragment.env_index), []).extend(fragment.versions.tolist())
    assert all(v == sorted(v) for v in by_env.values())


def publish_versions(fleet: Any, replay: Any, items: list[Any], last: int = 20) -> None:
    """Publish :func:`echo_weights` versions ``0 .. last`` to ``fleet`` and to the local ``replay`` (as a trainer
    does: the staleness bound then compares against versions), draining ``replay`` into ``items`` on the way;
    return once every worker has written and a fragment made only with ``last`` has arrived."""

    def collected(check: Any) -> bool:
        items.extend(drain_replay(replay))
        return check(items)

    fleet.publish(0, echo_weights(0))
    replay.publish_version(0)
    n_workers = len(fleet.workers())
    wait_until(lambda: collected(lambda got: len({f.worker_id for f in got}) == n_workers), "every worker")
    for version in range(1, last + 1):
        fleet.publish(version, echo_weights(version))
        replay.publish_version(version)
        time.sleep(0.02)  # spreads the versions over the workers' turns (not a time limit)
        items.extend(drain_replay(replay))
    wait_until(lambda: collected(lambda got: any(f.min_version == last for f in got)), f"version {last}")


def kill_all(pids: list[int]) -> list[int]:
    """SIGKILL each of ``pids``; returns those that were still there to kill."""
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:  # gone meanwhile
            pass
    return killed
