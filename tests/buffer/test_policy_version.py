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
from rollhub.wire.group import group_to_item

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


def test_the_next_batch_version_is_one_ahead_while_the_trainer_learns_from_a_batch_and_survives_a_restart(
    make_buffer: MakeBuffer,
) -> None:
    """What a producer's admission control budgets against: once the trainer was served a batch at version v, the
    next batch is trained at v + 1 even before v + 1 is published (leased or not, a batch counts when served)."""
    buffer = started(make_buffer(max_staleness=2), starting_step=4)
    assert buffer.status().next_batch_version is None  # nothing published: the step rule, nothing to budget
    for v in range(4):
        buffer.ingest([make_group([10 * v, 10 * v + 1], policy_version=0)])
    buffer.publish_version(0)
    assert (buffer.status().policy_version, buffer.status().next_batch_version) == (0, 0)
    assert buffer.next_batch(lease_s=60) is not None  # the trainer learns from it at version 0
    assert (buffer.status().policy_version, buffer.status().next_batch_version) == (0, 1)
    buffer.publish_version(1)
    assert buffer.status().next_batch_version == 1
    assert buffer.next_batch() is not None
    assert buffer.status().next_batch_version == 2
    assert make_buffer(max_staleness=2).status().next_batch_version == 2  # the step it was published at is kept
    buffer.publish_version(2)
    assert make_buffer(max_staleness=2).status().next_batch_version == 2
    buffer.reset()
    assert buffer.status().next_batch_version is None


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


def test_unversioned_groups_are_stamped_on_arrival_and_then_go_stale(make_buffer: MakeBuffer) -> None:
    """``stamp_unversioned`` (an Atropos environment's groups carry no version): a group gets the version the
    staleness rule compares against when it arrives; one that waits while the trainer moves on goes stale."""
    buffer = started(make_buffer(max_staleness=1, stamp_unversioned=True), starting_step=4)
    buffer.ingest([make_group([1, 2])])  # before any publish: the current step, 4
    buffer.publish_version(6)  # 6 - 4 > 1: the first group is dropped
    buffer.ingest([make_group([3, 4]), make_group([5, 6], policy_version=2)])  # stamped 6; a version is kept
    buffer.publish_version(7)  # 2 is stale at 7, 6 is fresh
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [3, 4]
    assert [item.policy_version for item in batch.items] == [6]
    assert group_to_item(batch.items[0])["policy_version"] == 6  # what the trainer reads
    assert buffer.next_batch() is None and buffer.status().stale_dropped == {"None": 2}

    restarted = make_buffer(max_staleness=1, stamp_unversioned=True)  # the stamp is stored with the group
    restarted.ingest([make_group([7, 8])])
    batch = restarted.next_batch()
    assert batch is not None and [item.policy_version for item in batch.items] == [7]


def test_without_stamping_unversioned_groups_stay_unversioned(buffer: ExperienceBuffer) -> None:
    started(buffer)
    buffer.publish_version(9)
    buffer.ingest([make_group([1, 2])])
    batch = buffer.next_batch()
    assert batch is not None and batch.items[0].policy_version is None
    assert "policy_version" not in group_to_item(batch.items[0])


def test_held_parts_are_stamped_each_and_merged_with_the_oldest_stamp(make_buffer: MakeBuffer) -> None:
    from rollhub.buffer import EnvRequest

    buffer = started(make_buffer(stamp_unversioned=True), batch_size=4)
    env = buffer.register_env(EnvRequest(max_token_length=64, desired_name="e", weight=1.0, group_size=4)).env
    assert env is not None
    buffer.publish_version(2)
    buffer.ingest([make_group([1, 2], env_id=env.env_id)])  # held: half a group, stamped 2
    buffer.publish_version(3)
    buffer.ingest([make_group([3, 4], env_id=env.env_id)])  # stamped 3; the two make one group
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [1, 2, 3, 4]
    assert [item.policy_version for item in batch.items] == [2]  # judged by its oldest part
