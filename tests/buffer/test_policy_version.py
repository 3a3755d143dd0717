"""The staleness clock: published policy versions, on every storage backend.

Before any publish the bound compares against ``current_step`` (a plain AtroposLib trainer); once the trainer
published a version it compares against that version, which never goes backwards and survives a restart.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from buffer_support import make_group, registration, served_tokens

from rollhub.buffer import ExperienceBuffer
from rollhub.errors import InvalidInput, VersionConflict
from rollhub.server.errors import http_status

MakeBuffer = Callable[..., ExperienceBuffer]


def started(buffer: ExperienceBuffer, batch_size: int = 2, starting_step: int = 0) -> ExperienceBuffer:
    buffer.register_trainer(registration(batch_size, starting_step=starting_step))
    buffer.mark_started()
    return buffer


def test_before_any_publish_the_current_step_rule_holds(make_buffer: MakeBuffer) -> None:
    buffer = started(make_buffer(max_staleness=1), starting_step=5)
    assert buffer.status().policy_version is None
    buffer.ingest([make_group([1, 2], policy_version=3)])  # 3 < 5 - 1: stale at step 5
    buffer.ingest([make_group([3, 4], policy_version=4)])  # 4 == 5 - 1: fresh
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [3, 4]
    assert buffer.next_batch() is None
    assert buffer.status().stale_dropped == {"None": 1}


def test_items_older_than_the_published_version_less_max_staleness_are_never_served(make_buffer: MakeBuffer) -> None:
    buffer = started(make_buffer(max_staleness=2))
    for v in range(6):
        buffer.ingest([make_group([10 * v, 10 * v + 1], policy_version=v)])
    buffer.ingest([make_group([100, 101])])  # unversioned: never stale
    answer = buffer.publish_version(5)  # the step is 0, the trainer holds version 5: 0, 1 and 2 are too old
    assert (answer.policy_version, answer.stale_dropped) == (5, 3)
    served = []
    while (batch := buffer.next_batch()) is not None:
        served.append(served_tokens(batch))
    assert served == [[30, 31], [40, 41], [50, 51], [100, 101]]
    status = buffer.status()
    assert status.stale_dropped == {"None": 3} and status.policy_version == 5
    assert status.current_step == 4  # serving still counts steps; only the staleness reference moved


def test_items_arriving_stale_after_a_publish_are_dropped_at_the_next_poll(make_buffer: MakeBuffer) -> None:
    buffer = started(make_buffer(max_staleness=0))
    buffer.publish_version(3)
    buffer.ingest([make_group([1, 2], policy_version=2), make_group([3, 4], policy_version=3)])
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [3, 4]
    assert buffer.next_batch() is None
    assert buffer.status().stale_dropped == {"None": 1}


def test_without_a_bound_a_publish_drops_nothing(buffer: ExperienceBuffer) -> None:
    started(buffer)
    buffer.ingest([make_group([1, 2], policy_version=0)])
    assert buffer.publish_version(100).stale_dropped == 0
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [1, 2]


def test_a_version_going_backwards_is_refused_naming_the_field(buffer: ExperienceBuffer) -> None:
    started(buffer)
    buffer.publish_version(4)
    buffer.publish_version(4)  # the same version again is fine (a retried request)
    with pytest.raises(VersionConflict) as err:
        buffer.publish_version(3)
    assert err.value.field == "policy_version" and http_status(err.value) == 409  # the server answers 409
    assert "3" in err.value.message and "4" in err.value.message
    assert buffer.status().policy_version == 4


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_a_version_not_a_whole_number_is_refused_naming_the_field(buffer: ExperienceBuffer, bad: object) -> None:
    with pytest.raises(InvalidInput) as err:
        buffer.publish_version(bad)  # type: ignore[arg-type]
    assert err.value.field == "policy_version"
    assert buffer.status().policy_version is None


def test_the_published_version_and_the_drops_survive_a_restart(make_buffer: MakeBuffer) -> None:
    buffer = started(make_buffer(max_staleness=1))
    buffer.ingest([make_group([1, 2], policy_version=0), make_group([3, 4], policy_version=2)])
    assert buffer.publish_version(2).stale_dropped == 1
    buffer.ingest([make_group([5, 6], policy_version=1)])  # fresh at 2, stale at 3

    restarted = make_buffer(max_staleness=1)
    assert restarted.status().policy_version == 2
    assert restarted.status().stale_dropped == {"None": 1}
    with pytest.raises(VersionConflict):
        restarted.publish_version(1)
    assert restarted.publish_version(3).stale_dropped == 1
    batch = restarted.next_batch()
    assert batch is not None and served_tokens(batch) == [3, 4]
    assert make_buffer(max_staleness=1).status().policy_version == 3


def test_reset_forgets_the_published_version(make_buffer: MakeBuffer) -> None:
    buffer = started(make_buffer(max_staleness=0))
    buffer.publish_version(7)
    buffer.reset()
    assert buffer.status().policy_version is None
    assert make_buffer(max_staleness=0).status().policy_version is None
    started(buffer, starting_step=3)
    buffer.ingest([make_group([1, 2], policy_version=3)])  # fresh again under the step rule
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [1, 2]


def test_a_publish_whose_write_fails_changes_nothing(make_buffer: MakeBuffer) -> None:
    buffer = started(make_buffer(max_staleness=0))
    buffer.ingest([make_group([1, 2], policy_version=0)])
    real_apply = buffer.storage.apply

    def failing(tx: object) -> None:
        raise OSError("disk went away")

    buffer.storage.apply = failing  # type: ignore[method-assign]
    with pytest.raises(OSError):
        buffer.publish_version(5)
    buffer.storage.apply = real_apply  # type: ignore[method-assign]
    status = buffer.status()
    assert status.policy_version is None and status.queue_size == 1 and status.stale_dropped == {}
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [1, 2]
