"""The buffer table's seams: a batch rule, staleness gate or admission plugged into :class:`rollhub.buffer.Table`
is what decides, and the table keeps its own guarantees (whole batches, leases, one transaction per change)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from buffer_support import make_group, registration, served_tokens

from rollhub.buffer import (
    BufferConfig,
    Entry,
    ExperienceBuffer,
    FragmentRule,
    PackingRule,
    Storage,
    Table,
    make_storage,
)
from rollhub.buffer.queue import Queue
from rollhub.buffer.staleness import StalenessClock
from rollhub.errors import ConfigError, QueueFull
from rollhub.experience import StalenessPolicy


class NewestFirst:
    """A batch rule that serves the newest items first (the opposite of the Atropos and fragment rules)."""

    def __init__(self) -> None:
        self.calls = 0

    def key(self) -> str:
        return "newest"

    def form(self, queue: Queue, batch_size: int) -> list[Entry] | None:
        self.calls += 1
        picked, total = [], 0
        for entry in reversed(list(queue)):
            if total + entry.size <= batch_size:
                picked.append(entry)
                total += entry.size
        return picked if total == batch_size else None


class OddVersionsStale(StalenessClock):
    """A staleness gate that also refuses every item of an odd policy version."""

    def drop_stale(self, queue: Queue, step: int) -> list[Entry]:
        odd = [e for e in queue if e.policy_version is not None and e.policy_version % 2]
        queue.remove(odd)
        return odd + super().drop_stale(queue, step)


class AtMost:
    """Admission that takes at most ``limit`` waiting sequences, even into an empty queue."""

    retry_after_s = 0.5

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def admit(self, waiting: int, incoming: int) -> None:
        if waiting + incoming > self.limit:
            raise QueueFull(f"more than {self.limit} sequences", retry_after_s=self.retry_after_s)


def table_on(open_storage: Callable[[], Storage], batch_size: int = 2, **parts: Any) -> Table:
    table = Table(open_storage(), BufferConfig(), **parts)
    table.register_trainer(registration(batch_size))
    return table


def test_a_custom_batch_rule_decides_the_batch(open_storage: Callable[[], Storage]) -> None:
    rule = NewestFirst()
    table = table_on(open_storage, rule=rule)
    for tag in (1, 2, 3, 4, 5):
        table.put(make_group([tag]), size=1)
    first = table.next_batch()
    assert first is not None and served_tokens(first) == [5, 4]
    assert [e.size for e in table.queued()] == [1, 1, 1]
    second = table.next_batch(lease_s=60)  # leases are the table's, whatever the rule
    assert second is not None and served_tokens(second) == [3, 2] and second.batch_id is not None
    calls = rule.calls
    assert table.next_batch() is None  # one item left: the rule forms nothing
    assert table.next_batch() is None and rule.calls == calls + 1  # unchanged queue, same key: not asked again
    table.ack(second.batch_id)


def test_a_custom_staleness_gate_decides_what_is_too_stale(open_storage: Callable[[], Storage]) -> None:
    table = table_on(open_storage, staleness=OddVersionsStale(StalenessPolicy(None)))
    for tag, version in ((1, 0), (2, 1), (3, 2), (4, 3), (5, 4)):
        table.put(make_group([tag]), size=1, policy_version=version)
    batch = table.next_batch()
    assert batch is not None and served_tokens(batch) == [1, 3]
    assert table.status().stale_dropped == {"None": 2}
    assert table.next_batch() is None  # item 5 alone
    assert table.publish_version(7).policy_version == 7  # the gate's own check accepts it; nothing odd is left
    assert table.status().policy_version == 7


def test_custom_admission_bounds_even_an_empty_table(open_storage: Callable[[], Storage]) -> None:
    table = table_on(open_storage, admission=AtMost(2))
    with pytest.raises(QueueFull):
        table.put(make_group([1, 2, 3]), size=3)
    table.put(make_group([1, 2]), size=2)
    assert table.counters.refused_full == 1
    assert table.status().queued_sequences == 2


def test_the_atropos_buffer_is_the_table_with_the_packing_rule(open_storage: Callable[[], Storage]) -> None:
    buffer = ExperienceBuffer(open_storage())
    assert isinstance(buffer, Table) and isinstance(buffer.rule, PackingRule)
    buffer.register_trainer(registration(2))
    buffer.ingest([make_group([1]), make_group([2, 3]), make_group([4])])
    batch = buffer.next_batch()  # packing: the two single groups make one pack of the largest size, 2
    assert batch is not None and served_tokens(batch) == [2, 3]


def test_the_fragment_rule_takes_the_oldest_whole_items(open_storage: Callable[[], Storage]) -> None:
    table = table_on(open_storage, batch_size=3, rule=FragmentRule())
    for tag in (1, 2, 3, 4):
        table.put(make_group([tag]), size=1)
    batch = table.next_batch()
    assert batch is not None and served_tokens(batch) == [1, 2, 3]
    assert table.next_batch() is None  # one sequence queued
    table.put(make_group([5, 6]), size=2)
    batch = table.next_batch()
    assert batch is not None and served_tokens(batch) == [4, 5, 6]
    table.put(make_group([7, 8]), size=2)
    table.put(make_group([9, 10]), size=2)
    assert table.next_batch() is None  # 2 + 2 overshoots 3: items are never split, nothing is taken
    assert table.status().queued_sequences == 4


def test_sqlite_storage_needs_a_codec(tmp_path) -> None:
    with pytest.raises(ConfigError) as err:
        make_storage(f"sqlite:///{tmp_path / 'x.db'}")
    assert err.value.field == "storage" and "codec" in str(err.value)
