"""rollhub's batch formation picks what AtroposLib 0.4.0 picks.

On random queues, ``pack_heterogeneous`` and ``pack_with_minimums`` must choose exactly the items of the
first batch 0.4.0's ``grab_exact_from_heterogeneous_queue`` / ``grab_batch_with_minimum_allocations`` form
(0.4.0 forms batches in the same order; rollhub serves the oldest first). The mixed-size combiner must
find a combination exactly when 0.4.0's does, and ``status_env`` must give 0.4.0's ``/status-env`` answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from buffer_support import env_request, make_group, reference_status_env, registration
from hypothesis import given, settings
from hypothesis import strategies as st

from rollhub.buffer import ExperienceBuffer, make_storage
from rollhub.buffer.batching import pack_heterogeneous, pack_with_minimums
from rollhub.buffer.envs import find_combination
from rollhub.errors import NotRegistered
from rollhub.server import shapes

utils = pytest.importorskip("atroposlib.api.utils", reason="atroposlib 0.4.0 is not installed")
reference_server = pytest.importorskip("atroposlib.api.server", reason="atroposlib 0.4.0 is not installed")


@dataclass
class Item:
    size: int
    env_id: int | None


def _reference_queue(entries: list[Item]) -> list[dict[str, Any]]:
    return [{"tokens": [[i]] * e.size, "env_id": e.env_id, "index": i} for i, e in enumerate(entries)]


def _picked(batch: list[dict[str, Any]] | None) -> list[int] | None:
    return None if batch is None else sorted(item["index"] for item in batch)


def _sorted(picked: list[int] | None) -> list[int] | None:
    return None if picked is None else sorted(picked)


POWERS = st.sampled_from([1, 2, 4, 8])
ANY_SIZE = st.integers(1, 8)
ENV = st.one_of(st.none(), st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.builds(Item, st.one_of(POWERS, ANY_SIZE), ENV), max_size=40),
    st.sampled_from([1, 2, 4, 8, 16, 32, 6, 12]),
)
def test_pack_heterogeneous_matches_0_4_0(entries: list[Item], batch_size: int) -> None:
    batch, _ = utils.grab_exact_from_heterogeneous_queue(_reference_queue(entries), batch_size)
    assert _sorted(pack_heterogeneous(entries, batch_size)) == _picked(batch)


@st.composite
def queues_with_minimums(draw: st.DrawFn) -> tuple[list[Item], list[dict[str, Any]]]:
    """Envs (some with minimums, some disconnected) and a queue drawn mostly from them."""
    n = draw(st.integers(1, 4))
    envs = [
        {
            "registered_id": i,
            "connected": i == 0 or draw(st.integers(0, 3)) > 0,
            "min_batch_allocation": draw(st.sampled_from([None, None, 0.0, 0.1, 0.25, 0.3, 0.5, 0.75])),
        }
        for i in range(n)
    ]
    env = st.one_of(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(0, n - 1), st.none())
    entries = draw(st.lists(st.builds(Item, POWERS, env), min_size=4, max_size=48))
    return entries, envs


@settings(max_examples=400, deadline=None)
@given(queues_with_minimums(), st.sampled_from([4, 8, 16, 32]))
def test_pack_with_minimums_matches_0_4_0(
    queue_and_envs: tuple[list[Item], list[dict[str, Any]]], batch_size: int
) -> None:
    entries, envs = queue_and_envs
    minimums = {
        e["registered_id"]: e["min_batch_allocation"]
        for e in envs
        if e["connected"] and e["min_batch_allocation"] is not None
    }
    batch, _ = utils.grab_batch_with_minimum_allocations(_reference_queue(entries), batch_size, envs)
    assert _sorted(pack_with_minimums(entries, batch_size, minimums)) == _picked(batch)


def test_pack_with_minimums_matches_0_4_0_on_a_queue_that_needs_the_minimum() -> None:
    # env 0 floods the queue first; env 1's minimum still takes half of the batch
    entries = [Item(2, 0)] * 6 + [Item(2, 1)] * 3
    envs = [
        {"registered_id": 0, "connected": True, "min_batch_allocation": None},
        {"registered_id": 1, "connected": True, "min_batch_allocation": 0.5},
    ]
    batch, _ = utils.grab_batch_with_minimum_allocations(_reference_queue(entries), 8, envs)
    picked = pack_with_minimums(entries, 8, {1: 0.5})
    assert _sorted(picked) == _picked(batch) == [0, 1, 6, 7]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 8), max_size=10), st.sampled_from([2, 4, 5, 6, 8]))
def test_combining_finds_a_combination_exactly_when_0_4_0_does(sizes: list[int], target: int) -> None:
    sizes = [min(s, target) for s in sizes]
    reference = utils.find_groups_summing_to_target([{"tokens": [[0]] * s} for s in sizes], target)
    picked = find_combination(sizes, target)
    assert bool(picked) == bool(reference)
    if picked:
        assert len(set(picked)) == len(picked)
        assert sum(sizes[i] for i in picked) == target


@st.composite
def registries(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[tuple[int | None, int]], list[int], int]:
    """Envs, queued groups (env, size), envs to disconnect, batch size."""
    envs = [
        {
            "group_size": draw(st.sampled_from([1, 2, 4, 8, 16])),
            "weight": draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])),
            "max_token_length": draw(st.sampled_from([0, 128, 4096])),
            "min_batch_allocation": draw(st.sampled_from([None, None, 0.0, 0.1, 0.3, 0.6])),
        }
        for _ in range(draw(st.integers(1, 4)))
    ]
    env = st.one_of(st.none(), st.integers(0, len(envs) - 1))
    queue = [(e, draw(st.sampled_from([1, 2, 4, 8]))) for e in draw(st.lists(env, max_size=25))]
    gone = draw(st.lists(st.integers(0, len(envs) - 1), max_size=2))
    return envs, queue, gone, draw(st.sampled_from([4, 8, 32, 100]))


@settings(max_examples=150, deadline=None)
@given(registries())
def test_status_env_matches_0_4_0(
    case: tuple[list[dict[str, Any]], list[tuple[int | None, int]], list[int], int],
) -> None:
    envs, queue, gone, batch_size = case
    buffer = ExperienceBuffer(make_storage("memory"))
    buffer.register_trainer(registration(batch_size, starting_step=3))
    buffer.mark_started()
    for env in envs:
        buffer.register_env(env_request(**{"name": "e", **env}))
    tag = 1
    for env_id, size in queue:
        # a group of the env's own size is queued as is (smaller ones would be held)
        n = size if env_id is None else envs[env_id]["group_size"]
        buffer.ingest([make_group(list(range(tag, tag + n)), env_id=env_id)])
        tag += n
    for env_id in gone:
        buffer.disconnect_env(env_id)
    connected_total = sum(e.max_token_length * e.weight for e in buffer.envs if e.connected)
    for env_id in range(len(envs)):
        if connected_total <= 0:  # 0.4.0 divides by zero here; rollhub answers 4xx
            with pytest.raises(NotRegistered):
                buffer.status_env(env_id)
            continue
        expected = reference_status_env(reference_server, buffer, env_id, batch_size=batch_size, step=3)
        assert shapes.status_env(buffer.status_env(env_id)) == pytest.approx(expected)
