"""One staleness clock end to end: a Ray fleet, the replay buffer and the PPO loop agree on ``max_staleness``.

Every fragment handed to the trainer is within the bound of the trainer's version at the time it trains on it,
the bound is exercised (the buffer dropped fragments that aged past it), and the trainer trains on every batch
whole: the buffer's guard (compared against the version the trainer published, so the two clocks never drift)
and the workers' admission are the only places the bound is applied.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.run.run_process import CORRIDOR
from tests.train.train_fakes import RecordingSource

ray = pytest.importorskip("ray")
pytest.importorskip("torch")


@pytest.fixture
def local_ray() -> Iterator[None]:
    """A local Ray runtime: the session's when another test module started one, else one of its own."""
    if ray.is_initialized():
        yield
        return
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.ray
def test_every_trained_fragment_is_within_the_bound_and_the_bound_drops_old_ones(local_ray: None) -> None:
    from rollhub.rollout.backends.ray import start_replay_buffer
    from rollhub.run.assemble import ppo_learner, step_fleet
    from rollhub.run.config import load_config, read_toml
    from rollhub.run.sources import RayReplaySource
    from rollhub.run.step_parts import probe_env
    from rollhub.train.ppo import PPOState, train_ppo

    max_staleness, updates = 0, 25
    # two envs cut fragments in pairs while a batch takes three: one fragment is left behind after every update
    sets = [f"writer.max_staleness={max_staleness}", "writer.batch_size=3", "fleet.envs_per_worker=2"]
    config = load_config(read_toml(CORRIDOR), sets)
    shape = probe_env(config)
    replay = start_replay_buffer(3, max_staleness, None, "memory")
    fleet = step_fleet(config, shape, replay)
    state, source = PPOState(), RecordingSource(RayReplaySource(replay, fleet))
    try:
        reason = train_ppo(
            ppo_learner(config, shape, None),
            source,
            fleet,
            state,
            stop_reason=lambda: None,
            after_update=lambda s, _: "done" if s.version >= updates else None,
        )
        buffer_status = ray.get(replay.status.remote())
    finally:
        fleet.stop()
    assert reason == "done" and state.version == updates
    assert len(source.handed) == updates, "every batch handed out was trained on"
    assert state.trained_steps == sum(f.length for _, batch in source.handed for f in batch), "and trained whole"
    for version, batch in source.handed:
        for fragment in batch:
            lags = version - fragment.versions
            assert np.all(lags <= max_staleness) and np.all(lags >= 0), (version, fragment.versions)
    assert buffer_status["policy_version"] == updates
    assert buffer_status["stale_dropped_total"] > 0, "the bound was exercised: the buffer dropped aged fragments"
    assert state.max_staleness_seen <= max_staleness, "the buffer's clock is the trainer's: nothing stale came"
