"""One local Ray runtime for the whole session (2 CPUs, small object store), shut down at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """Start ``ray.init(num_cpus=2)`` once; test helpers in ``rollout_fakes`` travel to workers by value."""
    ray = pytest.importorskip("ray")
    import group_worker_fakes
    import rollout_fakes

    ray.cloudpickle.register_pickle_by_value(rollout_fakes)
    ray.cloudpickle.register_pickle_by_value(group_worker_fakes)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 2**20,
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()
