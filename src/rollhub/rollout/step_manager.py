"""`StepRolloutManager`: batched inference over EnvWorker processes, cut into `SampleFragment`s.

One call to :meth:`StepRolloutManager.sample_batch` is one turn of the pipeline: wait until
``inference_batch_size`` observations are ready (receive), run one batched forward pass (inference), send the
actions back (send). Environments that have not answered yet keep running meanwhile, so slow and fast
environments overlap instead of waiting for the slowest one.
"""

from __future__ import annotations

import dataclasses
import functools
import select
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from rollhub.envs.step import EnvSpec
from rollhub.errors import ConfigError
from rollhub.experience import SampleFragment
from rollhub.rollout.env_worker import (
    Backoff,
    EnvResult,
    EnvWorker,
    EnvWorkerError,
    StartMethod,
    check_timer_slack,
)
from rollhub.rollout.fragments import FragmentBuffer, StepRecord
from rollhub.rollout.protocols import EpisodeResult, SampleRequest, SampleResult, StepPolicy


@dataclass(frozen=True)
class StepManagerConfig:
    """How a :class:`StepRolloutManager` runs its environments.

    Attributes:
        env: the environment recipe; every EnvWorker builds one instance.
        n_envs: number of EnvWorker processes.
        fragment_length: steps per :class:`SampleFragment`.
        inference_batch_size: observations to wait for before a forward pass (``None``: all ``n_envs``).
        gamma: discount of the reported discounted return.
        seed: base seed; environment ``i`` first resets with ``seed + i``.
        wait_timeout_s: how long no environment may answer before the manager gives up.
        backoff: restart policy of the environment processes.
        start_method: how environment processes start (``spawn`` or ``forkserver``; never a plain fork).
        timer_slack_ns: timer slack of the environment processes, in nanoseconds (Linux). The default, 1 µs,
            lets environments that wait on timers wake when they asked to instead of up to 50 µs later (the
            OS default for normal threads); ``None`` keeps the OS default.
    """

    env: EnvSpec
    n_envs: int = 4
    fragment_length: int = 64
    inference_batch_size: int | None = None
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
        batch = self.inference_batch_size
        if batch is not None and not 1 <= batch <= self.n_envs:
            raise ConfigError(f"inference_batch_size must be in [1, n_envs={self.n_envs}], got {batch}")


class _Slot:
    """Everything the manager tracks about one environment."""

    def __init__(self, index: int, worker: EnvWorker, buffer: FragmentBuffer) -> None:
        self.index = index
        self.worker = worker
        self.buffer = buffer
        self.arrival: EnvResult | None = None  # an observation waiting for an action
        self.in_flight = False  # an action was sent, the answer has not been read
        self.state: np.ndarray | None = None
        self.episode_id = 0
        self.ep_return = 0.0
        self.ep_discounted = 0.0
        self.ep_discount = 1.0
        self.ep_length = 0

    def new_episode(self, initial_state: np.ndarray | None) -> None:
        self.episode_id += 1
        self.ep_return, self.ep_discounted, self.ep_discount, self.ep_length = 0.0, 0.0, 1.0, 0
        self.state = initial_state


class StepRolloutManager:
    """Produces :class:`SampleFragment`s from ``n_envs`` EnvWorker processes with one local policy.

    Implements :class:`rollhub.rollout.protocols.RolloutManager`. Guarantees: every fragment has exactly
    ``fragment_length`` steps, all from one environment, each tagged with the ``policy_version`` of the
    ``sample_batch`` call that chose its action; an environment crash truncates (never terminates) the
    episode in flight; no fragment contains a step older than the ``min_version`` of a later request.

    Args:
        config: environment count, fragment length, batching.
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
        self._slots: list[_Slot] = []
        try:
            for i in range(config.n_envs):
                worker = EnvWorker(
                    config.env, config.seed + i, config.backoff, config.start_method, config.timer_slack_ns
                )
                buffer = FragmentBuffer(
                    config.fragment_length, worker_id=worker_id, env_index=i, task=config.env.task_name
                )
                self._slots.append(_Slot(i, worker, buffer))
            for slot in self._slots:
                slot.worker.launch()
            for slot in self._slots:
                slot.arrival = EnvResult(obs=slot.worker.first_obs())
                slot.new_episode(self.policy.initial_state())
        except BaseException:
            self.shutdown()
            raise

    def env_pids(self) -> list[int | None]:
        """Process ids of the environment processes, by slot (for supervision and tests)."""
        return [s.worker.pid for s in self._slots]

    def env_restarts(self) -> int:
        """Total environment process restarts so far."""
        return sum(s.worker.restarts for s in self._slots)

    def update_model(self, weights: Mapping[str, np.ndarray]) -> None:
        """Load new weights into the local policy (used from the next forward pass on)."""
        self.policy.load_weights(weights)

    def shutdown(self) -> None:
        """Stop every environment process; idempotent."""
        for slot in self._slots:
            slot.worker.close()

    def sample_batch(self, request: SampleRequest) -> SampleResult:
        """Run one receive / inference / send turn; return the fragments and episodes it completed."""
        result = SampleResult()
        if request.min_version is not None:
            for slot in self._slots:
                result.dropped_steps += slot.buffer.drop_if_older_than(request.min_version)
        t0 = time.perf_counter()
        self._receive(result)
        t1 = time.perf_counter()
        ready = [s for s in self._slots if s.arrival is not None]
        states = [self._account(slot, result) for slot in ready]
        obs = np.stack([np.asarray(s.arrival.obs) for s in ready])
        stacked_state = None if states[0] is None else np.stack(states)
        out = self.policy.act(obs, stacked_state)
        final_values = self._final_values(ready)
        t2 = time.perf_counter()
        for i, slot in enumerate(ready):  # actions first: the environments step while we do the bookkeeping
            slot.worker.send_step(out.actions[i])
            slot.in_flight = True
        t3 = time.perf_counter()
        for i, slot in enumerate(ready):
            record = StepRecord(
                obs=slot.arrival.obs,
                action=out.actions[i],
                logp=float(out.logp[i]),
                value=float(out.values[i]),
                version=request.policy_version,
                episode_id=slot.episode_id,
                state=states[i],
            )
            fragment = self._record(slot, record, final_values.get(slot.index, 0.0))
            if fragment is not None:
                result.items.append(fragment)
            slot.state = None if out.state is None else out.state[i]
            slot.arrival = None
        result.timings = {"recv_obs": t1 - t0, "inference": t2 - t1, "send_actions": t3 - t2}
        return result

    def _receive(self, result: SampleResult) -> None:
        """Read answers until at least ``inference_batch_size`` observations wait for an action."""
        deadline = time.monotonic() + self.config.wait_timeout_s
        while sum(s.arrival is not None for s in self._slots) < self._batch:
            flying = {s.worker.connection.fileno(): s for s in self._slots if s.in_flight}
            poller = select.poll()  # C-level poll: far cheaper per turn than multiprocessing's selectors
            for fd in flying:
                poller.register(fd, select.POLLIN)
            ready = poller.poll(max(deadline - time.monotonic(), 0.0) * 1000)
            if not ready:
                raise EnvWorkerError(
                    f"no environment answered within {self.config.wait_timeout_s} s "
                    f"({len(flying)} in flight); raise wait_timeout_s for slow environments"
                )
            for fd, _ in ready:
                slot = flying[fd]
                slot.arrival = slot.worker.recv_step()
                slot.in_flight = False
                if slot.arrival.crashed:
                    result.events.append(
                        f"env {slot.index} of {self.worker_id or 'worker'} restarted: {slot.arrival.error}"
                    )
                else:
                    result.env_steps += 1

    def _account(self, slot: _Slot, result: SampleResult) -> np.ndarray | None:
        """Update the episode statistics with the slot's arrival; return the state to act with."""
        a = slot.arrival
        if a.crashed:
            if slot.ep_length > 0:
                result.episodes.append(self._episode(slot, terminated=False, version=self._last_version(slot)))
            slot.new_episode(self.policy.initial_state())
            return slot.state
        slot.ep_return += a.reward
        slot.ep_discounted += slot.ep_discount * a.reward
        slot.ep_discount *= self.config.gamma
        slot.ep_length += 1
        if a.terminated or a.truncated:
            result.episodes.append(self._episode(slot, terminated=a.terminated, version=self._last_version(slot)))
            slot.new_episode(self.policy.initial_state())
        return slot.state

    def _final_values(self, ready: list[_Slot]) -> dict[int, float]:
        """Value estimates of the final observations of episodes truncated by their environment."""
        cut = [s for s in ready if s.arrival.truncated and not s.arrival.terminated and not s.arrival.crashed]
        if not cut:
            return {}
        values = self.policy.value(np.stack([np.asarray(s.arrival.final_obs) for s in cut]))
        return {s.index: float(v) for s, v in zip(cut, values, strict=True)}

    def _record(self, slot: _Slot, record: StepRecord, final_value: float) -> SampleFragment | None:
        """Attach the incoming transition to ``record`` and add it to the slot's buffer."""
        a = slot.arrival
        prev = slot.buffer.pending
        if not a.crashed:
            record.reward_in, record.terminated_in, record.truncated_in = a.reward, a.terminated, a.truncated
            record.final_value_in = 0.0 if a.terminated else final_value
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
