"""The step thread (``StepManagerConfig.step_thread``): the same experience as the inline manager, versions as
loaded, errors surfaced, a bounded lead, a clean stop."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest
from rollout_fakes import StepCounterPolicy, ValuePolicy, WeightEchoPolicy, check_versions_as_loaded, wait_until

from rollhub.envs import EnvSpec
from rollhub.errors import ConfigError
from rollhub.rollout.env_worker import Backoff, EnvWorkerError
from rollhub.rollout.protocols import SampleRequest, SampleResult
from rollhub.rollout.step_manager import StepManagerConfig, StepRolloutManager

FAST = Backoff(base_s=0.001)
UNNAMED = [5, 10, 15, 20, 25]  # versions loaded that no request names (test_steps_carry_the_version_...)


def _config(step_thread: bool, **kwargs: Any) -> StepManagerConfig:
    env = kwargs.pop("env", {"length": 5, "end": "truncate", "raise_at": 9})
    return StepManagerConfig(EnvSpec("rollout_fakes:CountingEnv", env), n_envs=3, env_processes=0,
                             fragment_length=4, backoff=FAST, step_thread=step_thread, **kwargs)  # fmt: skip


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


@pytest.mark.parametrize("policy", [ValuePolicy, StepCounterPolicy])
def test_the_step_thread_makes_the_same_experience_as_the_inline_manager(policy: type) -> None:
    """Truncations (final values), a crashing instance (restarted, its episode cut) and recurrent states: every
    fragment and episode the same, step for step."""
    out = {}
    for step_thread in (False, True):
        manager = StepRolloutManager(_config(step_thread), policy, worker_id="t")
        try:
            results = _run(manager, 150)
            restarts = manager.env_restarts()  # every instance raises on its 9th step, again once rebuilt
        finally:
            manager.shutdown()
        episodes = [dataclasses.astuple(e) for r in results for e in r.episodes][:20]
        out[step_thread] = (_fields(results, 8), episodes, restarts)
    plain, threaded = out[False], out[True]
    assert threaded[1] == plain[1] and len(plain[1]) == 20
    assert plain[2] >= 3 and threaded[2] >= 3
    assert sorted(threaded[0]) == sorted(plain[0]) == [0, 1, 2]
    for env, fields in plain[0].items():
        for name, value in fields.items():
            np.testing.assert_array_equal(threaded[0][env][name], value, err_msg=f"env {env} field {name}")
        assert fields["truncated"].any() and fields["final_values"].any(), "truncations bootstrap from values"


def test_steps_carry_the_version_of_the_weights_that_chose_them() -> None:
    """Weights change while the thread runs ahead: each step is tagged with the version loaded when its action was
    chosen, and a generation no request named counts as the version named before it (never a newer one)."""
    config = dataclasses.replace(_config(True), env=EnvSpec("sleep", {"step_s": 0.0005, "episode_length": 1000}))
    manager = StepRolloutManager(config, WeightEchoPolicy, worker_id="t")
    items = []
    thread = manager._thread
    assert thread is not None
    thread._max_ahead = 10**6  # never held at its bound: the test waits for turns made ahead
    try:
        for version in range(1, 30):
            if version > 1:  # turns made with the weights before are still to be taken when the new ones load
                wait_until(lambda: thread._made and thread._made[-1].generation == manager._generation,
                           "a turn made ahead with the weights loaded last")  # fmt: skip
            manager.update_model({"v": np.float32(version)})
            if version in UNNAMED:  # loaded, but no request names it: its steps count as the version before
                continue
            for r in _run(manager, 12, version):
                items += r.items
    finally:
        manager.shutdown()
    assert items
    named = [v for v in range(1, 30) if v not in UNNAMED]
    for fragment in items:
        loaded = -fragment.logp  # the echo policy's log-prob is minus the version of the weights it ran with
        skipped = np.isin(loaded, UNNAMED)
        np.testing.assert_array_equal(fragment.versions[skipped], loaded[skipped] - 1)
        np.testing.assert_array_equal(fragment.versions[~skipped], loaded[~skipped])
        assert set(fragment.versions.tolist()) <= set(named)
    check_versions_as_loaded([f for f in items if not np.isin(-f.logp, UNNAMED).any()])


def test_steps_older_than_the_bound_never_reach_a_fragment() -> None:
    manager = StepRolloutManager(_config(True, env={"length": 1000}), WeightEchoPolicy, worker_id="t")
    try:
        manager.update_model({"v": np.float32(1)})
        _run(manager, 30, 1)
        manager.update_model({"v": np.float32(2)})
        results = []
        while not any(f for r in results for f in r.items):
            results.append(manager.sample_batch(SampleRequest(2, "t", 2)))
    finally:
        manager.shutdown()
    fragments = [f for r in results for f in r.items]
    assert all((f.versions == 2).all() for f in fragments)
    assert sum(r.dropped_steps for r in results) > 0, "the held version-1 steps were dropped"


class _FailingPolicy(ValuePolicy):
    """Acts 20 times, then raises."""

    calls = 0

    def act(self, obs: np.ndarray, state: np.ndarray | None) -> Any:
        self.calls += 1
        if self.calls > 20:
            raise ValueError("scripted policy failure")
        return super().act(obs, state)


def test_an_error_in_the_thread_surfaces_in_sample_batch_after_what_was_made_before_it() -> None:
    manager = StepRolloutManager(_config(True, env={"length": 1000}), _FailingPolicy, worker_id="t")
    steps = 0
    try:
        with pytest.raises(EnvWorkerError, match="step thread stopped: ValueError: scripted policy failure"):
            while True:
                steps += manager.sample_batch(SampleRequest(0, "t", None)).env_steps
    finally:
        manager.shutdown()
    assert steps == 3 * 19, "the 20 forward passes made 19 steps of 3 environments (the first act is on resets)"


def test_an_instance_that_keeps_failing_stops_the_manager_with_its_name() -> None:
    config = dataclasses.replace(_config(True, env={"raise_at": 1}), backoff=Backoff(base_s=0.001, max_failures=2))
    manager = StepRolloutManager(config, ValuePolicy, worker_id="t")
    try:
        with pytest.raises(EnvWorkerError, match=r"instance \d .*failed 3 times in a row"):
            for _ in range(100):
                manager.sample_batch(SampleRequest(0, "t", None))
    finally:
        manager.shutdown()


def test_the_thread_runs_a_bounded_way_ahead_and_stops_with_the_manager() -> None:
    manager = StepRolloutManager(_config(True, env={"length": 1000}), ValuePolicy, worker_id="t")
    thread = manager._thread
    assert thread is not None
    try:
        manager.sample_batch(SampleRequest(0, "t", None))  # starts the thread
        wait_until(lambda: len(thread._made) >= thread._max_ahead, "the thread to fill its lead")
        held = len(thread._made)
        result = manager.sample_batch(SampleRequest(0, "t", None))
        assert held == thread._max_ahead and result.forward_passes == held, "it waited at its bound"
        assert result.env_steps == 3 * result.forward_passes
    finally:
        manager.shutdown()
    assert not thread._thread.is_alive()
    assert not any(t.name == "rollhub-step-thread" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("processes", [None, 2])
def test_a_step_thread_needs_the_environments_in_the_worker(processes: int | None) -> None:
    with pytest.raises(ConfigError, match=r"step_thread .*needs env_processes=0"):
        StepManagerConfig(EnvSpec("CartPole-v1"), env_processes=processes, step_thread=True)
