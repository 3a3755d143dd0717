"""Combining held groups costs bounded work per request, whatever the registered group_size and the held groups.

The work is counted (subset-sum cells visited, ``CombineWork.cells``) rather than timed."""

from __future__ import annotations

import itertools

import pytest
from buffer_support import env_request, make_group, registration, served_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from rollhub.buffer import ExperienceBuffer, make_storage
from rollhub.buffer.envs import MAX_COMBINE_CELLS, MAX_GROUP_SIZE, CombineWork, find_combination
from rollhub.errors import InvalidInput
from rollhub.server import shapes


def started(buffer: ExperienceBuffer, batch_size: int = 8) -> ExperienceBuffer:
    buffer.register_trainer(registration(batch_size))
    buffer.mark_started()
    return buffer


@pytest.mark.parametrize("group_size", [MAX_GROUP_SIZE + 1, 10**9])
def test_register_env_refuses_a_group_size_over_the_maximum(buffer: ExperienceBuffer, group_size: int) -> None:
    started(buffer)
    with pytest.raises(InvalidInput) as err:
        buffer.register_env(env_request(group_size=group_size))
    assert err.value.field == "group_size"
    assert str(group_size) in err.value.message and str(MAX_GROUP_SIZE) in err.value.message
    assert buffer.envs == []
    assert shapes.register_env(buffer.register_env(env_request(group_size=MAX_GROUP_SIZE)))["env_id"] == 0


def _brute_force(sizes: list[int], target: int) -> bool:
    return any(
        sum(sizes[i] for i in combo) == target
        for r in range(1, len(sizes) + 1)
        for combo in itertools.combinations(range(len(sizes)), r)
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 20), max_size=11), st.integers(1, 40))
def test_a_combination_is_found_exactly_when_one_exists(sizes: list[int], target: int) -> None:
    sizes = [min(s, target) for s in sizes]
    work = CombineWork()
    picked = find_combination(sizes, target, work)
    assert bool(picked) == _brute_force(sizes, target)
    assert not work.capped and work.cells <= MAX_COMBINE_CELLS
    if picked:
        assert picked == sorted(set(picked)) and sum(sizes[i] for i in picked) == target
        for i in picked:  # of each size, the earliest groups are the ones taken
            same = [k for k, s in enumerate(sizes) if s == sizes[i]]
            assert same.index(i) < sum(1 for k in picked if sizes[k] == sizes[i])


def test_first_fit_in_arrival_order_is_kept_and_the_search_fills_in_otherwise() -> None:
    assert find_combination([1, 2, 5, 1], 4) == [0, 1, 3]  # first fit, earliest first
    work = CombineWork()
    assert find_combination([3, 4, 5], 9, work) == [1, 2]  # 3 + 4 leaves no room for 5; 4 + 5 does
    assert work.cells > 0
    work = CombineWork()
    assert find_combination([1] * 100, MAX_GROUP_SIZE, work) == [] and work.cells == 0  # still filling up


def test_the_search_stops_at_its_cell_cap_on_adversarial_sizes() -> None:
    # 1,024 distinct even sizes can never add up to an odd group size; an unbounded search would visit
    # ~67 million cells here (and far more as more groups are held).
    target = MAX_GROUP_SIZE - 1
    sizes = list(range(2, 2050, 2))
    work = CombineWork()
    assert find_combination(sizes, target, work) == []
    assert work.capped and work.cells <= MAX_COMBINE_CELLS
    small = CombineWork()
    assert find_combination(sizes, target, small, max_cells=10 * (target + 1)) == []
    assert small.capped and small.cells == 10 * (target + 1)


def test_ingest_work_per_request_stays_bounded_with_a_large_group_size() -> None:
    buffer = started(ExperienceBuffer(make_storage("memory")))
    target = MAX_GROUP_SIZE - 1  # odd: even-sized groups are held forever, so every request searches
    buffer.register_env(env_request(group_size=target))
    tags = itertools.count(1)
    searched, cells = 0, []
    for size in itertools.islice(itertools.cycle(range(1000, 3000, 14)), 160):
        out = buffer.ingest([make_group([next(tags) for _ in range(size)], env_id=0)])
        assert out[0].buffered
        work = buffer.last_combine
        assert work is not None
        cells.append(work.cells)
        searched += work.cells > 0
    assert max(cells) <= MAX_COMBINE_CELLS
    assert searched > 100, "the held total passed group_size, so the later requests did search"
    assert buffer.held_sequences(0) == sum(itertools.islice(itertools.cycle(range(1000, 3000, 14)), 160))


def test_groups_of_a_large_group_size_still_merge_earliest_first() -> None:
    buffer = started(ExperienceBuffer(make_storage("memory")), batch_size=9)
    buffer.register_env(env_request(group_size=9))
    tags = itertools.count(1)
    for size in (3, 4, 5):
        buffer.ingest([make_group([next(tags) for _ in range(size)], env_id=0)])
    assert buffer.held_sequences(0) == 3  # 4 + 5 merged, the group of 3 still held
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == list(range(4, 13))
