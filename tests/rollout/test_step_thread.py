"""The step threads (``StepManagerConfig.step_threads``): the same experience as the inline manager, versions as
loaded, errors surfaced, a bounded lead, a clean stop."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rollout_fakes import (
    StepCounterPolicy,
    ValuePolicy,
    WeightEchoPolicy,
    check_versions_as_loaded,
    echo_weights,
    wait_until,
)

from rollhub.envs import EnvSpec
from rollhub.errors import ConfigError
from rollhub.rollout.protocols import SampleRequest, SampleResult
from rollhub.rollout.step.env_worker import Backoff, EnvWorkerError
from rollhub.rollout.step.manager import StepManagerConfig, StepRolloutManager
from rollhub.rollout.step.threads import StepThreads

FAST = Backoff(base_s=0.001)
UNNAMED = [5, 10, 15, 20, 25]  # versions loaded that no request names (test_steps_carry_the_version_...)


def _config(step_threads: int, **kwargs: Any) -> StepManagerConfig:
    env = kwargs.pop("env", {"length": 5, "end": "truncate", "raise_at": 9, "mark_seed": True})
    return StepManagerConfig(EnvSpec("rollout_fakes:CountingEnv", env), n_envs=3, env_processes=0,
                             fragment_length=4, backoff=FAST, step_threads=step_threads, **kwargs)  # fmt: skip


def _threads(manager: StepRolloutManager) -> StepThreads:
    assert manager._threads is not None
    return manager._threads


def _run(manager: StepRolloutManager, steps: int, version: int = 0) -> list[SampleResult]:
    results: list[SampleResult] = []
    while sum(r.env_steps for r in results) < steps:
        results.append(manager.sample_batch(SampleRequest(version, "t", None)))
    return results


def _fields(results: list[SampleResult], n: int) -> dict[int, dict[str, np.ndarray]]:
    """Per environment, every field of its first ``n`` fragments, joined."""
    out: dict[int, dict[str, list]] = {}
    for f in (f for r in results for f in r.items):
        env = out.setdefault(f.env_index, {})
        if len(env.get("obs", [])) < n:
            for name in ("obs", "actions", "rewards", "terminated", "truncated", "logp", "values", "final_values",
                         "versions", "episode_ids", "state_in"):  # fmt: skip
                env.setdefault(name, []).append(np.asarray(getattr(f, name)))
    return {i: {k: np.stack(v) for k, v in env.items()} for i, env in out.items()}


def _experience(policy: type, step_threads: int) -> tuple[dict, list, int]:
    """Every field of each environment's first 8 fragments, its first 6 episodes, and the restarts."""
    manager = StepRolloutManager(_config(step_threads), policy, worker_id="t")
    results: list[SampleResult] = []
    by_env: dict[int, list] = {0: [], 1: [], 2: []}  # the threads interleave the environments' episodes
    fragments = [0, 0, 0]
    try:
        while min(fragments) < 8 or min(map(len, by_env.values())) < 6:  # however unevenly the threads ran
            results.append(manager.sample_batch(SampleRequest(0, "t", None)))
            for f in results[-1].items:
                fragments[f.env_index] += 1
            for e in results[-1].episodes:
                by_env[int(e.ret // (1000 * e.length))].append(dataclasses.astuple(e))
        restarts = manager.env_restarts()  # every instance raises on its 9th step, again once rebuilt
    finally:
        manager.shutdown()
    return _fields(results, 8), {env: episodes[:6] for env, episodes in by_env.items()}, restarts


@pytest.mark.parametrize("step_threads", [1, 2, 3])
@pytest.mark.parametrize("policy", [ValuePolicy, StepCounterPolicy])
def test_the_step_threads_make_the_same_experience_as_the_inline_manager(policy: type, step_threads: int) -> None:
    """Truncations (final values), a crashing instance (restarted, its episode cut) and recurrent states: every
    fragment and episode the same, step for step, however the environments are split over threads."""
    plain = _experience(policy, 0)
    threaded = _experience(policy, step_threads)
    assert threaded[1] == plain[1]
    assert plain[2] >= 3 and threaded[2] >= 3
    assert sorted(threaded[0]) == sorted(plain[0]) == [0, 1, 2]
    for env, fields in plain[0].items():
        for name, value in fields.items():
            np.testing.assert_array_equal(threaded[0][env][name], value, err_msg=f"env {env} field {name}")
        assert fields["truncated"].any() and fields["final_values"].any(), "truncations bootstrap from values"


@pytest.mark.parametrize("step_threads", [1, 3])
def test_steps_carry_the_version_of_the_weights_that_chose_them(step_threads: int) -> None:
    """Weights change while the threads run ahead: each step is tagged with the version loaded when its action was
    chosen, and a generation no request named counts as the version named before it (never a newer one)."""
    env = EnvSpec("sleep", {"step_s": 0.0005, "episode_length": 1000})
    manager = StepRolloutManager(dataclasses.replace(_config(step_threads), env=env), WeightEchoPolicy, worker_id="t")
    items = []
    group = _threads(manager)
    group.max_ahead = 10**6  # never held at their bound: the test waits for turns made ahead
    try:
        for version in range(1, 30):
            if version > 1:  # turns made with the weights before are still to be taken when the new ones load
                wait_until(lambda: all(t.made and t.made[-1].generation == manager._generation for t in group.threads),
                           "a turn made ahead with the weights loaded last, in every thread")  # fmt: skip
            manager.update_model({"v": np.float32(version)})
            if version in UNNAMED:  # loaded, but no request names it: its steps count as the version before
                continue
            for r in _run(manager, 12, version):
                items += r.items
    finally:
        manager.shutdown()
    assert {f.env_index for f in items} == {0, 1, 2}
    assert len(manager._versions) <= 3, "versions no turn to come can have are forgotten"
    named = [v for v in range(1, 30) if v not in UNNAMED]
    for fragment in items:
        loaded = -fragment.logp  # the echo policy's log-prob is minus the version of the weights it ran with
        skipped = np.isin(loaded, UNNAMED)
        np.testing.assert_array_equal(fragment.versions[skipped], loaded[skipped] - 1)
        np.testing.assert_array_equal(fragment.versions[~skipped], loaded[~skipped])
        assert set(fragment.versions.tolist()) <= set(named)
    check_versions_as_loaded([f for f in items if not np.isin(-f.logp, UNNAMED).any()])


def test_a_thread_held_back_keeps_the_versions_of_the_weights_it_acted_with(tmp_path: Path) -> None:
    """Environment 2 blocks in its first step while the others take in versions 1 to 5: its first step is still
    tagged version 1 when it comes, and its next ones version 5."""
    gate = tmp_path / "gate"
    env = EnvSpec("rollout_fakes:GateEnv", {"gate": str(gate), "gated": [2]})
    manager = StepRolloutManager(dataclasses.replace(_config(3), env=env), WeightEchoPolicy, worker_id="t")
    items: list[Any] = []
    try:
        for version in range(1, 6):
            manager.update_model(echo_weights(version))
            while not {0, 1} <= {f.env_index for f in items if (f.versions == version).all()}:
                items += manager.sample_batch(SampleRequest(version, "t", None)).items
        assert 2 not in {f.env_index for f in items}
        gate.touch()
        while 2 not in {f.env_index for f in items}:
            items += manager.sample_batch(SampleRequest(5, "t", None)).items
    finally:
        gate.touch()
        manager.shutdown()
    first = next(f for f in items if f.env_index == 2)
    assert first.versions.tolist() == [1, 5, 5, 5]
    check_versions_as_loaded(items)


@pytest.mark.parametrize("step_threads", [1, 3])
def test_steps_older_than_the_bound_never_reach_a_fragment(step_threads: int) -> None:
    manager = StepRolloutManager(_config(step_threads, env={"length": 1000}), WeightEchoPolicy, worker_id="t")
    try:
        manager.update_model({"v": np.float32(1)})
        _run(manager, 30, 1)
        while max(manager.held_records()) < 2:  # a completed step is held (a lone record still waits for its reward)
            manager.sample_batch(SampleRequest(1, "t", None))
        manager.update_model({"v": np.float32(2)})
        results = []
        while len({f.env_index for r in results for f in r.items}) < 3:
            results.append(manager.sample_batch(SampleRequest(2, "t", 2)))
    finally:
        manager.shutdown()
    fragments = [f for r in results for f in r.items]
    assert all((f.versions == 2).all() for f in fragments)
    assert sum(r.dropped_steps for r in results) > 0, "the held version-1 steps were dropped"


class _FailingPolicy(ValuePolicy):
    """Acts 20 times in the thread named ``fails`` (without end in the others), then raises there."""

    fails = ""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def act(self, obs: np.ndarray, state: np.ndarray | None) -> Any:
        if threading.current_thread().name.startswith(self.fails):
            self.calls += 1
            if self.calls > 20:
                raise ValueError("scripted policy failure")
        return super().act(obs, state)


@pytest.mark.parametrize("step_threads", [1, 3])
def test_an_error_in_a_thread_surfaces_in_sample_batch_after_what_it_made_before(step_threads: int) -> None:
    """The failing thread's 20 turns are all recorded (each environment of it holds or shipped 20 records), then
    its error stops the manager, even while the other threads have turns to take."""
    policy = type("Failing", (_FailingPolicy,), {"fails": f"rollhub-step-thread-{step_threads - 1}"})
    manager = StepRolloutManager(_config(step_threads, env={"length": 1000}), policy, worker_id="t")
    shipped = [0, 0, 0]
    group = _threads(manager)
    try:
        with pytest.raises(EnvWorkerError, match="step thread stopped: ValueError: scripted policy failure"):
            for _ in range(5000):  # without the error this would end
                for f in manager.sample_batch(SampleRequest(0, "t", None)).items:
                    shipped[f.env_index] += len(f.actions)  # records; the last one stays held for the next
                wait_until(lambda: all(t.made or t.error for t in group.threads), "a turn from every thread")
    finally:
        manager.shutdown()
    records = [n + held for n, held in zip(shipped, manager.held_records(), strict=True)]
    failing = [2] if step_threads == 3 else [0, 1, 2]
    assert [records[env] for env in failing] == [20] * len(failing)


def test_an_instance_that_keeps_failing_stops_the_manager_with_its_name() -> None:
    config = dataclasses.replace(_config(3, env={"raise_at": 1}), backoff=Backoff(base_s=0.001, max_failures=2))
    manager = StepRolloutManager(config, ValuePolicy, worker_id="t")
    try:
        with pytest.raises(EnvWorkerError, match=r"instance \d .*failed 3 times in a row"):
            for _ in range(100):
                manager.sample_batch(SampleRequest(0, "t", None))
    finally:
        manager.shutdown()


@pytest.mark.parametrize("step_threads", [1, 3])
def test_the_threads_run_a_bounded_way_ahead_and_stop_with_the_manager(step_threads: int) -> None:
    manager = StepRolloutManager(_config(step_threads, env={"length": 1000}), ValuePolicy, worker_id="t")
    group = _threads(manager)
    try:
        while not all(unit.started for unit in manager._units):  # starts the threads; takes their first turns
            manager.sample_batch(SampleRequest(0, "t", None))
        wait_until(lambda: all(len(t.made) >= group.max_ahead for t in group.threads), "the threads to fill their lead")
        held = sum(len(t.made) for t in group.threads)
        result = manager.sample_batch(SampleRequest(0, "t", None))
        assert held == step_threads * group.max_ahead and result.forward_passes == held, "they waited at the bound"
        assert result.env_steps == 3 * group.max_ahead and result.inference_batch == 3 * group.max_ahead
    finally:
        manager.shutdown()
    assert len(group.threads) == step_threads and not any(t.thread.is_alive() for t in group.threads)
    assert not any(t.name.startswith("rollhub-step-thread") and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("processes", [None, 2])
def test_step_threads_need_the_environments_in_the_worker(processes: int | None) -> None:
    with pytest.raises(ConfigError, match=r"step_threads .*need env_processes=0, got"):
        StepManagerConfig(EnvSpec("CartPole-v1"), env_processes=processes, step_threads=2)


@pytest.mark.parametrize("threads", [-1, 5, True, 1.5])
def test_step_threads_are_a_count_of_at_most_one_per_environment(threads: Any) -> None:
    with pytest.raises(ConfigError, match=r"step_threads must be a whole number in \[0, n_envs=4\]"):
        StepManagerConfig(EnvSpec("CartPole-v1"), n_envs=4, env_processes=0, step_threads=threads)
