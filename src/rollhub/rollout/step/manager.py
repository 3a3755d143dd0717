"""`StepRolloutManager`: batched inference over vectorized EnvWorker processes, cut into `SampleFragment`s.

The manager's ``n_envs`` environments live in ``env_processes`` processes, each stepping its share as one vector
(one pipe message per vector per step). One call to :meth:`StepRolloutManager.sample_batch` is one turn of the
pipeline: wait for the first process to answer, take every other answer that is ready (waiting at most
``batch_wait_s`` more while fewer than ``inference_batch_size`` environments are ready), run one batched forward
pass, send each process its actions. Processes that have not answered keep stepping meanwhile: with two
processes (the default) inference for one half overlaps with stepping the other, and a slow process never holds
back the ones that are ready. Each process's steps are recorded column by column
(:class:`rollhub.rollout.step.fragments.FragmentColumns`) and its episodes in flight are tracked as arrays, so the
bookkeeping of a turn is a few array operations per process, not Python work per environment.

With ``env_processes=0`` and ``step_threads=k`` the inline environments are split into ``k`` vectors, each stepped,
and its actions chosen, in a thread of its own (:mod:`rollhub.rollout.step.threads`); ``sample_batch`` then records
the turns those threads made since the last call.
"""

from __future__ import annotations

import dataclasses
import functools
import select
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rollhub.inference.base import PolicyStep
from rollhub.rollout.protocols import EpisodeResult, SampleRequest, SampleResult, StepPolicy
from rollhub.rollout.step.config import StepManagerConfig
from rollhub.rollout.step.env_worker import EnvWorker, EnvWorkerError, InlineEnvWorker, VectorResult
from rollhub.rollout.step.fragments import FragmentColumns
from rollhub.rollout.step.threads import Made, StepThreads


class _Unit:
    """One environment process (or inline vector), its instances' records and their episodes in flight."""

    def __init__(self, worker: EnvWorker | InlineEnvWorker, indices: range, columns: FragmentColumns,
                 initial_state: np.ndarray | None) -> None:  # fmt: skip
        n = len(indices)
        self.worker = worker
        self.indices = indices
        self.columns = columns
        self.arrival: VectorResult | None = None  # answers waiting for actions
        self.in_flight = False  # actions were sent, the answer has not been read
        self.started = False  # the first answer is the first observations: no transition led to them
        self.episode_id = np.ones(n, np.int64)
        self.ep_return = np.zeros(n)
        self.ep_discounted = np.zeros(n)
        self.ep_discount = np.ones(n)
        self.ep_length = np.zeros(n, np.int64)
        self.states = None if initial_state is None else np.stack([initial_state] * n)
        self.generation = 0  # the weight generation of the newest turn taken from its step thread

    def new_episode(self, j: int, initial_state: np.ndarray | None) -> None:
        self.episode_id[j] += 1
        self.ep_return[j], self.ep_discounted[j], self.ep_discount[j], self.ep_length[j] = 0.0, 0.0, 1.0, 0
        if self.states is not None:
            self.states[j] = initial_state


def _split(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous pieces whose sizes differ by at most one."""
    bounds = [n * k // parts for k in range(parts + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


class StepRolloutManager:
    """Produces :class:`SampleFragment`s from ``n_envs`` environments in vectorized EnvWorker processes with one
    local policy.

    Implements :class:`rollhub.rollout.protocols.RolloutManager`. Guarantees: every fragment has exactly
    ``fragment_length`` steps, all from one environment, in the order they were taken, each tagged with the
    ``policy_version`` of the ``sample_batch`` call that chose its action (with step threads: of the weights
    loaded when its thread chose it); an environment crash truncates (never
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
        self._inline = config.processes == 0  # every vector is stepped in this thread: nothing to wait for
        self._threads: StepThreads | None = None
        self._policy_lock = threading.Lock()  # a step thread's forward pass never sees half-loaded weights
        self._generation = 0  # weights loaded so far
        self._versions: dict[int, int] = {}  # generation -> the version a request gave it (step threads)
        try:
            for part in _split(config.n_envs, max(config.processes, config.step_threads, 1)):
                worker = self._env_worker(len(part), config.seed + part.start)
                columns = FragmentColumns(config.fragment_length, part, worker_id=worker_id, task=config.env.task_name)
                self._units.append(_Unit(worker, part, columns, self.policy.initial_state()))
            for unit in self._units:
                unit.worker.launch()
            for unit in self._units:
                first = unit.worker.first_obs()
                n = len(unit.indices)
                unit.arrival = VectorResult(first, np.zeros(n), np.zeros(n, bool), np.zeros(n, bool), {}, {})
            if config.step_threads:
                vectors = []
                for unit in self._units:
                    assert isinstance(unit.worker, InlineEnvWorker) and unit.arrival is not None
                    vectors.append((unit.worker, unit.arrival, None if unit.states is None else unit.states.copy()))
                    unit.arrival = None
                self._threads = StepThreads(vectors, self._act_for_thread, self.policy.initial_state())
        except BaseException:
            self.shutdown()
            raise

    def _env_worker(self, n: int, seed: int) -> EnvWorker | InlineEnvWorker:
        c = self.config
        if c.processes == 0:
            return InlineEnvWorker(c.env, n, seed, c.backoff, c.timer_slack_ns)
        return EnvWorker(c.env, n, seed, c.backoff, c.start_method, c.timer_slack_ns)

    def env_pids(self) -> list[int | None]:
        """Process ids of the environment processes (for supervision and tests; none when inline)."""
        return [u.worker.pid for u in self._units if not u.worker.inline]

    def env_restarts(self) -> int:
        """Environment instance restarts so far (every instance of a restarted process counts)."""
        return sum(u.worker.restarts for u in self._units)

    def update_model(self, weights: Mapping[str, np.ndarray]) -> None:
        """Load new weights into the local policy (used from the next forward pass on)."""
        with self._policy_lock:
            self.policy.load_weights(weights)
            self._generation += 1

    def shutdown(self) -> None:
        """Stop the step threads and every environment process; idempotent."""
        if self._threads is not None:
            self._threads.close(self.config.wait_timeout_s)
        for unit in self._units:
            unit.worker.close()

    def held_records(self) -> list[int]:
        """Records each environment holds towards its next fragment (for tests and debugging)."""
        return [count for unit in self._units for count in unit.columns.held()]

    def sample_batch(self, request: SampleRequest) -> SampleResult:
        """Run one receive / inference / send turn; return the fragments and episodes it completed."""
        result = SampleResult()
        if self._threads is not None:
            return self._sample_made(request, result)
        if request.min_version is not None:
            for unit in self._units:
                result.dropped_steps += unit.columns.drop_older_than(request.min_version)
        t0 = time.perf_counter()
        self._receive(result)
        t1 = time.perf_counter()
        ready = [u for u in self._units if u.arrival is not None]
        for unit in ready:
            self._account(unit, result)
        obs = np.concatenate([u.arrival.obs for u in ready]) if len(ready) > 1 else ready[0].arrival.obs
        states = _joined([u.states for u in ready])
        out = self.policy.act(obs, states)
        final_values = self._final_values([u.arrival for u in ready])  # type: ignore[misc]
        t2 = time.perf_counter()
        bounds, start = [], 0
        for unit in ready:  # actions first: the environments step while we do the bookkeeping
            bounds.append(slice(start, start + len(unit.indices)))
            unit.worker.send_step(out.actions[bounds[-1]])
            unit.in_flight = True
            start = bounds[-1].stop
        t3 = time.perf_counter()
        for unit, rows, final in zip(ready, bounds, final_values, strict=True):
            self._record(unit, obs[rows], out, rows, request.policy_version, final, result)
            unit.arrival = None
        result.inference_batch = start
        result.timings = {"recv_obs": t1 - t0, "inference": t2 - t1, "send_actions": t3 - t2}
        return result

    def _receive(self, result: SampleResult) -> None:
        """Wait for the first answer (up to ``wait_timeout_s``), take every answer that is ready, then keep taking
        answers for up to ``batch_wait_s`` while fewer than ``inference_batch_size`` environments are ready."""
        for unit in self._units:
            if unit.in_flight and unit.worker.inline:
                self._take(unit, result)
        if self._inline:
            return
        wait_s = self.config.wait_timeout_s
        gather_until: float | None = None
        while True:
            flying = {u.worker.connection.fileno(): u for u in self._units if u.in_flight}
            have = sum(len(u.indices) for u in self._units if u.arrival is not None)
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

    def _sample_made(self, request: SampleRequest, result: SampleResult) -> SampleResult:
        """Record the turns the step threads made since the last call, each with the version of the weights
        that chose its actions (a generation no request named counts as the newest named before it)."""
        self._versions[self._generation] = request.policy_version
        assert self._threads is not None
        if not self._threads.started:  # they start now: no turn of theirs can have an older generation
            for unit in self._units:
                unit.generation = self._generation
        t0 = time.perf_counter()
        taken = self._threads.take(self.config.wait_timeout_s)
        t1 = time.perf_counter()
        timings = {"wait": t1 - t0, "recv_obs": 0.0, "inference": 0.0, "send_actions": 0.0}
        result.forward_passes = 0
        for unit, made in zip(self._units, taken, strict=True):
            for turn in made:
                self._record_turn(unit, turn, request, result)
                timings["recv_obs"] += turn.step_s
                timings["inference"] += turn.act_s
            result.inference_batch += len(unit.indices) * len(made)
            result.forward_passes += len(made)
        oldest = self._named(min(u.generation for u in self._units))  # the oldest generation a turn to come has
        self._versions = {g: v for g, v in self._versions.items() if g >= oldest}
        result.timings = timings
        return result

    def _record_turn(self, unit: _Unit, turn: Made, request: SampleRequest, result: SampleResult) -> None:
        """Record one turn of ``unit``'s step thread."""
        if request.min_version is not None:  # a turn made before the bound rose is dropped like a held one
            result.dropped_steps += unit.columns.drop_older_than(request.min_version)
        unit.arrival = turn.arrival
        if unit.started:
            self._arrived(unit, result)
        self._account(unit, result)
        unit.states = turn.states
        version = self._versions[self._named(turn.generation)]
        self._record(unit, turn.arrival.obs, turn.out, slice(None), version, turn.final_values, result)
        unit.arrival = None
        unit.generation = turn.generation

    def _named(self, generation: int) -> int:
        """The newest generation at or before ``generation`` that a request named a version for."""
        return max(g for g in self._versions if g <= generation)

    def _act_for_thread(self, arrival: VectorResult, states: np.ndarray | None) -> tuple[PolicyStep, Any, int]:
        """A step thread's forward pass: actions and final values, with the generation of the weights."""
        with self._policy_lock:
            out = self.policy.act(arrival.obs, states)
            return out, self._final_values([arrival])[0], self._generation

    def _take(self, unit: _Unit, result: SampleResult) -> None:
        """Read one process's answer."""
        unit.arrival = unit.worker.recv_step()
        unit.in_flight = False
        self._arrived(unit, result)

    def _arrived(self, unit: _Unit, result: SampleResult) -> None:
        """Note the restarts and count the steps of the answer in ``unit.arrival``."""
        assert unit.arrival is not None
        for j, error in unit.arrival.crashed.items():
            result.events.append(f"env {unit.indices[j]} of {self.worker_id or 'worker'} restarted: {error}")
        result.env_steps += len(unit.indices) - len(unit.arrival.crashed)

    def _account(self, unit: _Unit, result: SampleResult) -> None:
        """Update the episodes in flight of ``unit`` with the transitions that just arrived."""
        a = unit.arrival
        assert a is not None
        if not unit.started:  # the first observations: no transition led to them
            unit.started = True
            return
        ok: np.ndarray | None = None
        if a.crashed:  # the episode in flight is lost: report what it had, start a new one
            ok = np.ones(len(unit.indices), bool)
            for j in a.crashed:
                ok[j] = False
                if unit.ep_length[j] > 0:
                    result.episodes.append(self._episode(unit, j, terminated=False))
                unit.new_episode(j, self.policy.initial_state())
        rewards = a.rewards if ok is None else np.where(ok, a.rewards, 0.0)
        unit.ep_return += rewards
        unit.ep_discounted += unit.ep_discount * rewards
        if ok is None:
            unit.ep_discount *= self.config.gamma
            unit.ep_length += 1
        else:
            unit.ep_discount[ok] *= self.config.gamma
            unit.ep_length += ok
        for j in a.final_obs:  # the instances whose episode ended (never one that crashed)
            result.episodes.append(self._episode(unit, j, terminated=bool(a.terminated[j])))
            unit.new_episode(j, self.policy.initial_state())

    def _final_values(self, arrivals: list[VectorResult]) -> list[np.ndarray | float]:
        """Per answer: the value estimates of the final observations of episodes truncated by their environment
        (0 elsewhere)."""
        cut: list[tuple[int, int, object]] = []
        for k, a in enumerate(arrivals):
            cut += [(k, j, o) for j, o in a.final_obs.items() if a.truncated[j] and not a.terminated[j]]
        out: list[np.ndarray | float] = [0.0] * len(arrivals)
        if not cut:
            return out
        values = self.policy.value(np.stack([np.asarray(o) for _, _, o in cut]))
        for (k, j, _), v in zip(cut, values, strict=True):
            if isinstance(out[k], float):
                out[k] = np.zeros(len(arrivals[k].terminated), np.float32)
            out[k][j] = v  # type: ignore[index]
        return out

    def _record(self, unit: _Unit, obs: np.ndarray, out: PolicyStep, rows: slice, version: int,
                final_values: np.ndarray | float, result: SampleResult) -> None:  # fmt: skip
        """Record what the policy did with ``unit``'s observations, with the transitions that led to them."""
        a = unit.arrival
        assert a is not None
        fields = {"logp": out.logp[rows], "value": out.values[rows], "version": version,
                  "episode_id": unit.episode_id, "reward_in": a.rewards, "terminated_in": a.terminated,
                  "truncated_in": a.truncated, "final_value_in": final_values}  # fmt: skip
        if a.crashed:
            self._crash_fields(unit, fields)
        result.items += unit.columns.append(obs, out.actions[rows], fields, unit.states, list(a.crashed))
        if out.state is not None:
            unit.states = np.array(out.state[rows], copy=True)

    @staticmethod
    def _crash_fields(unit: _Unit, fields: dict) -> None:
        """The incoming transition of a crashed instance's new first observation, which replaces the newest
        record: the action chosen there never got an answer, so that step is dropped and the episode that
        reached it is cut as truncated, bootstrapping from its value estimate."""
        n = len(unit.indices)
        for name, dtype in (("reward_in", np.float64), ("terminated_in", bool), ("truncated_in", bool),
                            ("final_value_in", np.float32)):  # fmt: skip
            fields[name] = np.array(np.broadcast_to(fields[name], n), dtype)
        assert unit.arrival is not None
        for j in unit.arrival.crashed:
            prev = unit.columns.pending(j)
            if prev is None:
                reward, terminated, truncated, final = 0.0, False, False, 0.0
            elif prev.terminated_in or prev.truncated_in:  # prev.obs already started a new, empty episode
                reward, terminated, truncated, final = (
                    prev.reward_in,
                    prev.terminated_in,
                    prev.truncated_in,
                    prev.final_value_in,
                )  # its incoming transition, as it was
            else:
                reward, terminated, truncated, final = prev.reward_in, False, True, prev.value
            fields["reward_in"][j], fields["terminated_in"][j] = reward, terminated
            fields["truncated_in"][j], fields["final_value_in"][j] = truncated, final

    def _episode(self, unit: _Unit, j: int, *, terminated: bool) -> EpisodeResult:
        """Environment ``j``'s episode as it stands, tagged with the version of its last recorded step."""
        prev = unit.columns.pending(j)
        return EpisodeResult(
            task=self.config.env.task_name,
            ret=float(unit.ep_return[j]),
            discounted_return=float(unit.ep_discounted[j]),
            length=int(unit.ep_length[j]),
            terminated=terminated,
            version=prev.version if prev is not None else -1,
        )


def _joined(states: list[np.ndarray | None]) -> np.ndarray | None:
    """The recurrent states of the ready units as one batch (``None`` for feed-forward policies)."""
    if states[0] is None:
        return None
    return np.concatenate(states) if len(states) > 1 else states[0]  # type: ignore[arg-type]


def _build(config: StepManagerConfig, policy_factory: Callable[[], StepPolicy], worker_id: str) -> StepRolloutManager:
    seed = config.seed + 1000 * (zlib.crc32(worker_id.encode()) % 100_000)
    return StepRolloutManager(dataclasses.replace(config, seed=seed), policy_factory, worker_id)


def step_manager_factory(
    config: StepManagerConfig, policy_factory: Callable[[], StepPolicy]
) -> Callable[[str], StepRolloutManager]:
    """A picklable ``worker_id -> StepRolloutManager`` for :class:`RolloutWorker`; seeds differ per worker id."""
    return functools.partial(_build, config, policy_factory)
