"""The buffer's queue and batch former against plain-list models: same order, same figures, same batches.

The queue keeps running figures and a per-version index so that a poll does not walk it; these tests check the
figures against a recount after random changes, rollbacks included, and that the batch former picks exactly
what the list-based packing rule picks.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from rollhub.buffer.batching import BatchFormer, pack_heterogeneous, pack_with_minimums
from rollhub.buffer.queue import Queue
from rollhub.buffer.storage import Entry

entry_specs = st.tuples(
    st.sampled_from([1, 2, 4, 8]), st.sampled_from([None, 0, 1]), st.one_of(st.none(), st.integers(0, 6))
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), entry_specs),
        st.tuples(st.just("remove"), st.integers(0, 50)),
        st.tuples(st.just("drop"), st.integers(0, 7)),
    ),
    max_size=30,
)


def check_figures(queue: Queue, model: list[Entry]) -> None:
    assert [e.gid for e in queue] == [e.gid for e in model]
    assert queue.sequences == sum(e.size for e in model) and len(queue) == len(model)
    assert queue.max_size() == max((e.size for e in model), default=0)
    recount: dict[int | None, tuple[int, int, Counter[int]]] = {}
    for e in model:
        groups, sequences, sizes = recount.get(e.env_id, (0, 0, Counter()))
        recount[e.env_id] = (groups + 1, sequences + e.size, sizes + Counter([e.size]))
    assert {k: (r.groups, r.sequences, r.sizes) for k, r in queue.by_env().items()} == recount
    assert queue.last() == (model[-1] if model else None)


def apply(queue: Queue, model: list[Entry], ops: list[tuple[str, object]], gids: list[int]) -> None:
    for op, arg in ops:
        if op == "add":
            size, env_id, version = arg  # type: ignore[misc]
            gids[0] += 1
            entry = Entry(gids[0], size, env_id, version)
            queue.append(entry)
            model.append(entry)
        elif op == "remove" and model:
            victim = model.pop(arg % len(model))  # type: ignore[operator]
            queue.remove([victim])
        elif op == "drop":
            dropped = queue.drop_older_than(arg)  # type: ignore[arg-type]
            expected = [e for e in model if e.policy_version is not None and e.policy_version < arg]  # type: ignore[operator]
            assert sorted(e.gid for e in dropped) == sorted(e.gid for e in expected)
            model[:] = [e for e in model if e not in expected]


@settings(max_examples=150, deadline=None)
@given(before=operations, during=operations)
def test_running_figures_and_rollback_match_a_list_model(
    before: list[tuple[str, object]], during: list[tuple[str, object]]
) -> None:
    queue, model, gids = Queue(), [], [0]
    apply(queue, model, before, gids)
    check_figures(queue, model)
    saved = list(model)
    queue.begin()
    apply(queue, model, during, gids)
    check_figures(queue, model)
    queue.rollback()
    check_figures(queue, saved)
    queue.begin()
    apply(queue, saved, during, gids)
    queue.commit()
    check_figures(queue, saved)


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([None, 0, 1])), max_size=40),
    batch_size=st.sampled_from([1, 2, 4, 8, 16]),
    minimum=st.sampled_from([None, 0.25, 0.5]),
)
def test_the_batch_former_picks_what_the_list_rules_pick(
    specs: list[tuple[int, int | None]], batch_size: int, minimum: float | None
) -> None:
    entries = [Entry(i + 1, size, env_id) for i, (size, env_id) in enumerate(specs)]
    queue = Queue(entries)
    if minimum is None:
        picked = pack_heterogeneous(entries, batch_size)
        formed = BatchFormer.packing().form(queue, batch_size)
    else:
        picked = pack_with_minimums(entries, batch_size, {0: minimum})
        formed = BatchFormer.with_minimums({0: minimum}).form(queue, batch_size)
    assert formed == (None if picked is None else [entries[i] for i in picked])
    assert [e.gid for e in queue] == [e.gid for e in entries]  # forming a batch changes nothing


def test_a_rollback_puts_a_batch_taken_from_the_middle_back_in_place() -> None:
    entries = [Entry(g, 2, g % 2, g) for g in range(1, 9)]
    queue = Queue(entries)
    queue.begin()
    queue.remove([entries[5], entries[2]])
    queue.drop_older_than(3)
    queue.append(Entry(99, 4))
    queue.rollback()
    assert [e.gid for e in queue] == list(range(1, 9))
    assert queue.drop_older_than(3) == entries[:2]  # the version index came back too
