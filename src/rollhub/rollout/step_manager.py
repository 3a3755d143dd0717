"""`StepRolloutManager`: batched inference over vectorized EnvWorker processes, cut into `SampleFragment`s.

The manager's ``n_envs`` environments live in ``env_processes`` processes, each stepping its share as one vector
(one pipe message per vector per step). One call to :meth:`StepRolloutManager.sample_batch` is one turn of the
pipeline: wait for the first process to answer, take every other answer that is ready (waiting at most
``batch_wait_s`` more while fewer than ``inference_batch_size`` environments are ready), run one batched forward
pass, send each process its actions. Processes that have not answered keep stepping meanwhile: with two
processes (the default) inference for one half overlaps with stepping the other, and a slow process never holds
back the ones that are ready.
"""

from __future__ import annotations

import dataclasses
import functools
import select
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from rollhub.envs.step import EnvSpec
from rollhub.errors import ConfigError
from rollhub.experience import SampleFragment
from rollhub.rollout.env_worker import (
    Backoff,
    EnvWorker,
    EnvWorkerError,
    InlineEnvWorker,
    StartMethod,
    VectorResult,
    check_timer_slack,
)
from rollhub.rollout.fragments import FragmentBuffer, StepRecord
from rollhub.rollout.protocols import EpisodeResult, SampleRequest, SampleResult, StepPolicy


@dataclass(frozen=True)
class StepManagerConfig:
    """How a :class:`StepRolloutManager` runs its environments.

    Attributes:
        env: the environment recipe; every instance is built from it.
        n_envs: environment instances.
        env_processes: processes the instances are spread over (as evenly as possible; ``None``: 2, or 1 for a
            single environment). Each process steps its instances one after the other and answers with one
            message, so cheap environments want few processes (2: one half steps while the policy acts for
            the other) and slow ones, that wait or compute for milliseconds, one process each (``n_envs``).
            0 steps them in the manager's own thread, with no process and no pipe: the fastest for environments
            that take microseconds (see :class:`rollhub.rollout.env_worker.InlineEnvWorker`).
        fragment_length: steps per :class:`SampleFragment`.
        inference_batch_size: environments to gather before a forward pass, waiting at most ``batch_wait_s``
            for them after the first answer (``None``: all ``n_envs``).
        batch_wait_s: the longest a ready observation waits for more to batch with (0: act on what is ready).
        gamma: discount of the reported discounted return.
        seed: base seed; environment ``i`` first resets with ``seed + i``.
        wait_timeout_s: how long no environment may answer before the manager gives up.
        backoff: restart policy of the environment instances and processes.
        start_method: how environment processes start (``spawn`` or ``forkserver``; never a plain fork).
        timer_slack_ns: timer slack of the environment processes, in nanoseconds (Linux). The default, 1 µs,
            lets environments that wait on timers wake when they asked to instead of up to 50 µs later (the
            OS default for normal threads); ``None`` keeps the OS default.
    """

    env: EnvSpec
    n_envs: int = 4
    env_processes: int | None = None
    fragment_length: int = 64
    inference_batch_size: int | None = None
    batch_wait_s: float = 0.0
    gamma: float = 0.99
    seed: int = 0
    wait_timeout_s: float = 60.0
    backoff: Backoff = field(default_factory=Backoff)
    start_method: StartMethod = "spawn"
    timer_slack_ns: int | None = 1000

    def __post_init__(self) -> None:
        check_timer_slack(self.timer_slack_ns)
        if self.n_envs < 1:
            raise ConfigError(f"n_envs must be >= 1, got {self.n_envs}")
        procs = self.env_processes
        if procs is not None and not 0 <= procs <= self.n_envs:
            raise ConfigError(f"env_processes must be in [0, n_envs={self.n_envs}] (0: inline), got {procs}")
        batch = self.inference_batch_size
        if batch is not None and not 1 <= batch <= self.n_envs:
            raise ConfigError(f"inference_batch_size must be in [1, n_envs={self.n_envs}], got {batch}")
        if not self.batch_wait_s >= 0:
            raise ConfigError(f"batch_wait_s must be >= 0 seconds, got {self.batch_wait_s}")

    @property
    def processes(self) -> int:
        """The number of environment processes (``env_processes`` or its default)."""
        return self.env_processes if self.env_processes is not None else min(2, self.n_envs)


class _Incoming(NamedTuple):
    """The transition that led to an environment's newest observation."""

    reward: float
    terminated: bool
    truncated: bool
    crashed: bool


class _Slot:
    """Everything the manager tracks about one environment instance."""

    def __init__(self, index: int, buffer: FragmentBuffer) -> None:
        self.index = index
        self.buffer = buffer
        self.state: np.ndarray | None = None
        self.started = False
        self.episode_id = 0
        self.ep_return = 0.0
        self.ep_discounted = 0.0
        self.ep_discount = 1.0
        self.ep_length = 0

    def new_episode(self, initial_state: np.ndarray | None) -> None:
        self.episode_id += 1
        self.ep_return, self.ep_discounted, self.ep_discount, self.ep_length = 0.0, 0.0, 1.0, 0
        self.state = initial_state


class _Unit:
    """One environment process and the slots of its instances."""

    def __init__(self, worker: EnvWorker | InlineEnvWorker, slots: list[_Slot]) -> None:
        self.worker = worker
        self.slots = slots
        self.arrival: VectorResult | None = None  # answers waiting for actions
        self.in_flight = False  # actions were sent, the answer has not been read


def _split(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous pieces whose sizes differ by at most one."""
    bounds = [n * k // parts for k in range(parts + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


class StepRolloutManager:
    """Produces :class:`SampleFragment`s from ``n_envs`` environments in vectorized EnvWorker processes with one
    local policy.

    Implements :class:`rollhub.rollout.protocols.RolloutManager`. Guarantees: every fragment has exactly
    ``fragment_length`` steps, all from one environment, in the order they were taken, each tagged with the
    ``policy_version`` of the ``sample_batch`` call that chose its action; an environment crash truncates (never
    terminates) the episode in flight; no fragment contains a step older than the ``min_version`` of a later
    request.

    Args:
        config: environment count, processes, fragment length, batching.
        policy_factory: builds the local inference policy (called once, in this process).
        worker_id: copied into every fragment.
    """

    def __init__(
        self, config: StepManagerConfig, policy_factory: Callable[[], StepPolicy], worker_id: str = ""
    ) -> None:
        self.config = config
        self.policy = policy_factory()
        self.worker_id = worker_id
        self._batch = config.inference_batch_size or config.n_envs
        self._units: list[_Unit] = []
        self._slots: list[_Slot] = []
        try:
            for part in _split(config.n_envs, max(config.processes, 1)):
                worker = self._env_worker(len(part), config.seed + part.start)
                slots = [self._new_slot(i) for i in part]
                self._units.append(_Unit(worker, slots))
                self._slots += slots
            for unit in self._units:
                unit.worker.launch()
            for unit in self._units:
                first = unit.worker.first_obs()
                n = len(unit.slots)
                unit.arrival = VectorResult(first, np.zeros(n), np.zeros(n, bool), np.zeros(n, bool))
                for slot in unit.slots:
                    slot.new_episode(self.policy.initial_state())
        except BaseException:
            self.shutdown()
            raise

    def _env_worker(self, n: int, seed: int) -> EnvWorker | InlineEnvWorker:
        c = self.config
        if c.processes == 0:
            return InlineEnvWorker(c.env, n, seed, c.backoff)
        return EnvWorker(c.env, n, seed, c.backoff, c.start_method, c.timer_slack_ns)

    def _new_slot(self, index: int) -> _Slot:
        buffer = FragmentBuffer(
            self.config.fragment_length, worker_id=self.worker_id, env_index=index, task=self.config.env.task_name
        )
        return _Slot(index, buffer)

    def env_pids(self) -> list[int | None]:
        """Process ids of the environment processes (for supervision and tests; none when inline)."""
        return [u.worker.pid for u in self._units if not u.worker.inline]

    def env_restarts(self) -> int:
        """Environment instance restarts so far (every instance of a restarted process counts)."""
        return sum(u.worker.restarts for u in self._units)

    def update_model(self, weights: Mapping[str, np.ndarray]) -> None:
        """Load new weights into the local policy (used from the next forward pass on)."""
        self.policy.load_weights(weights)

    def shutdown(self) -> None:
        """Stop every environment process; idempotent."""
        for unit in self._units:
            unit.worker.close()

    def sample_batch(self, request: SampleRequest) -> SampleResult:
        """Run one receive / inference / send turn; return the fragments and episodes it completed."""
        result = SampleResult()
        if request.min_version is not None:
            for slot in self._slots:
                result.dropped_steps += slot.buffer.drop_if_older_than(request.min_version)
        t0 = time.perf_counter()
        self._receive(result)
        t1 = time.perf_counter()
        ready = [u for u in self._units if u.arrival is not None]
        slots: list[_Slot] = []
        incoming: list[_Incoming] = []
        for unit in ready:
            a = unit.arrival
            crashed = [j in a.crashed for j in range(len(unit.slots))]
            for slot, *step in zip(unit.slots, a.rewards.tolist(), a.terminated.tolist(), a.truncated.tolist(),
                                   crashed, strict=True):  # fmt: skip
                incoming.append(_Incoming(*step))
                self._account(slot, incoming[-1], result)
                slots.append(slot)
        obs = np.concatenate([u.arrival.obs for u in ready]) if len(ready) > 1 else ready[0].arrival.obs
        states = [s.state for s in slots]
        stacked_state = None if states[0] is None else np.stack(states)
        out = self.policy.act(obs, stacked_state)
        final_values = self._final_values(ready)
        t2 = time.perf_counter()
        start = 0
        for unit in ready:  # actions first: the environments step while we do the bookkeeping
            unit.worker.send_step(out.actions[start : start + len(unit.slots)])
            unit.in_flight = True
            start += len(unit.slots)
        t3 = time.perf_counter()
        logps, values, version = out.logp.tolist(), out.values.tolist(), request.policy_version
        for i, slot in enumerate(slots):
            record = StepRecord(obs[i], out.actions[i], logps[i], values[i], version, slot.episode_id, states[i])
            fragment = self._record(slot, record, incoming[i], final_values.get(slot.index, 0.0))
            if fragment is not None:
                result.items.append(fragment)
            slot.state = None if out.state is None else out.state[i]
        for unit in ready:
            unit.arrival = None
        result.inference_batch = len(slots)
        result.timings = {"recv_obs": t1 - t0, "inference": t2 - t1, "send_actions": t3 - t2}
        return result

    def _receive(self, result: SampleResult) -> None:
        """Wait for the first answer (up to ``wait_timeout_s``), take every answer that is ready, then keep taking
        answers for up to ``batch_wait_s`` while fewer than ``inference_batch_size`` environments are ready."""
        for unit in self._units:
            if unit.in_flight and unit.worker.inline:
                self._take(unit, result)
        wait_s = self.config.wait_timeout_s
        gather_until: float | None = None
        while True:
            flying = {u.worker.connection.fileno(): u for u in self._units if u.in_flight}
            have = sum(len(u.slots) for u in self._units if u.arrival is not None)
            if not flying or have >= self._batch:
                return
            if have and gather_until is None:
                gather_until = time.monotonic() + self.config.batch_wait_s
            timeout = wait_s if gather_until is None else max(gather_until - time.monotonic(), 0.0)
            poller = select.poll()  # C-level poll: far cheaper per turn than multiprocessing's selectors
            for fd in flying:
                poller.register(fd, select.POLLIN)
            ready = poller.poll(timeout * 1000)
            if not ready:
                if have:
                    return
                raise EnvWorkerError(
                    f"no environment answered within {wait_s} s ({len(flying)} processes in flight); "
                    "raise wait_timeout_s for slow environments"
                )
            for fd, _ in ready:
                self._take(flying[fd], result)

    def _take(self, unit: _Unit, result: SampleResult) -> None:
        """Read one process's answer."""
        unit.arrival = unit.worker.recv_step()
        unit.in_flight = False
        for j, error in unit.arrival.crashed.items():
            slot = unit.slots[j]
            result.events.append(f"env {slot.index} of {self.worker_id or 'worker'} restarted: {error}")
        result.env_steps += len(unit.slots) - len(unit.arrival.crashed)

    def _account(self, slot: _Slot, step: _Incoming, result: SampleResult) -> None:
        """Update the episode statistics of ``slot`` with the transition that just arrived."""
        if step.crashed:
            if slot.ep_length > 0:
                result.episodes.append(self._episode(slot, terminated=False, version=self._last_version(slot)))
            slot.new_episode(self.policy.initial_state())
            return
        if not slot.started:  # the first observation: no transition led to it
            slot.started = True
            return
        slot.ep_return += step.reward
        slot.ep_discounted += slot.ep_discount * step.reward
        slot.ep_discount *= self.config.gamma
        slot.ep_length += 1
        if step.terminated or step.truncated:
            version = self._last_version(slot)
            result.episodes.append(self._episode(slot, terminated=step.terminated, version=version))
            slot.new_episode(self.policy.initial_state())

    def _final_values(self, ready: list[_Unit]) -> dict[int, float]:
        """Value estimates of the final observations of episodes truncated by their environment."""
        cut: list[tuple[_Slot, object]] = []
        for unit in ready:
            a = unit.arrival
            cut += [(unit.slots[j], o) for j, o in a.final_obs.items() if a.truncated[j] and not a.terminated[j]]
        if not cut:
            return {}
        values = self.policy.value(np.stack([np.asarray(o) for _, o in cut]))
        return {s.index: float(v) for (s, _), v in zip(cut, values, strict=True)}

    def _record(self, slot: _Slot, record: StepRecord, step: _Incoming, final_value: float) -> SampleFragment | None:
        """Attach the transition that led to ``record``'s observation to it; add it to the slot's buffer."""
        prev = slot.buffer.pending
        if not step.crashed:
            record.reward_in, record.terminated_in, record.truncated_in = step.reward, step.terminated, step.truncated
            record.final_value_in = 0.0 if step.terminated else final_value
            return slot.buffer.append(record)
        if prev is not None:
            # The action chosen at prev.obs never got an answer: drop that step and cut the episode that
            # reached prev.obs as truncated, bootstrapping from the value of prev.obs.
            record.reward_in = prev.reward_in
            if prev.terminated_in or prev.truncated_in:  # prev.obs already started a new, empty episode
                record.terminated_in, record.truncated_in = prev.terminated_in, prev.truncated_in
                record.final_value_in = prev.final_value_in
            else:
                record.truncated_in, record.final_value_in = True, prev.value
        slot.buffer.replace_pending(record)
        return None

    @staticmethod
    def _last_version(slot: _Slot) -> int:
        prev = slot.buffer.pending
        return prev.version if prev is not None else -1

    def _episode(self, slot: _Slot, *, terminated: bool, version: int) -> EpisodeResult:
        return EpisodeResult(
            task=self.config.env.task_name,
            ret=slot.ep_return,
            discounted_return=slot.ep_discounted,
            length=slot.ep_length,
            terminated=terminated,
            version=version,
        )


def _build(config: StepManagerConfig, policy_factory: Callable[[], StepPolicy], worker_id: str) -> StepRolloutManager:
    seed = config.seed + 1000 * (zlib.crc32(worker_id.encode()) % 100_000)
    return StepRolloutManager(dataclasses.replace(config, seed=seed), policy_factory, worker_id)


def step_manager_factory(
    config: StepManagerConfig, policy_factory: Callable[[], StepPolicy]
) -> Callable[[str], StepRolloutManager]:
    """A picklable ``worker_id -> StepRolloutManager`` for :class:`RolloutWorker`; seeds differ per worker id."""
    return functools.partial(_build, config, policy_factory)
