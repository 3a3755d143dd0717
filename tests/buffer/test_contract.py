"""The ExperienceBuffer contract, run against every storage backend.

Covers trainer registration, the env registry (ids, W&B names, disconnect), ``status`` and the 0.4.0
``status-env`` arithmetic, mixed-size group combining, batch formation (size, whole groups, oldest first,
step counting), minimum allocations, staleness, backpressure, leases, ``latest_example``, ``reset`` and
restart from the same storage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from buffer_support import env_request, make_group, reference_status_env, registration, scored, served_tokens

from rollhub.buffer import BufferConfig, ExperienceBuffer, Storage, Table
from rollhub.errors import InvalidInput, NotRegistered, QueueFull, UnknownBatch, UnknownEnv
from rollhub.server import shapes
from rollhub.server.storage import GROUP_CODEC

MakeBuffer = Callable[..., ExperienceBuffer]


def started(buffer: ExperienceBuffer, batch_size: int = 8, **reg: Any) -> ExperienceBuffer:
    """Register the trainer and mark it started, so environments may register."""
    buffer.register_trainer(registration(batch_size, **reg))
    buffer.mark_started()
    return buffer


class Tags:
    """Hands out unique sequence tags (token ids)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


# ------------------------------------------------------------------------------------------ registration


def test_before_register_nothing_is_configured(buffer: ExperienceBuffer) -> None:
    assert shapes.info(buffer.run) == {"batch_size": -1, "max_token_len": -1}
    assert shapes.wandb_info(buffer.run) == {"group": None, "project": None}
    assert buffer.status().current_step == 0
    with pytest.raises(NotRegistered):
        buffer.next_batch()
    with pytest.raises(NotRegistered):
        buffer.mark_started()
    with pytest.raises(NotRegistered):
        buffer.status_env(0)


def test_first_register_configures_the_run(buffer: ExperienceBuffer) -> None:
    uid = buffer.register_trainer(registration(batch_size=16, starting_step=7))
    assert isinstance(uid, int)
    assert shapes.info(buffer.run) == {"batch_size": 16, "max_token_len": 2048}
    assert shapes.wandb_info(buffer.run) == {"group": "group", "project": "project"}
    assert buffer.status().current_step == 7


def test_later_register_updates_params_but_keeps_queue_envs_and_step(buffer: ExperienceBuffer) -> None:
    first = buffer.register_trainer(registration(batch_size=4, starting_step=3))
    buffer.mark_started()
    env = shapes.register_env(buffer.register_env(env_request(group_size=4)))
    buffer.ingest([make_group([1, 2, 3, 4], env_id=env["env_id"])])
    buffer.ingest([make_group([5, 6, 7, 8], env_id=env["env_id"])])
    assert buffer.next_batch() is not None
    second = buffer.register_trainer(
        registration(batch_size=8, starting_step=0, wandb_project="other", checkpoint_dir="/new")
    )
    assert second != first
    assert shapes.info(buffer.run)["batch_size"] == 8
    assert shapes.wandb_info(buffer.run)["project"] == "other"
    assert buffer.status().current_step == 4  # starting_step of the later call is ignored
    assert buffer.status().queue_size == 1
    assert shapes.status_env(buffer.status_env(env["env_id"]))["self_queue_size"] == 1
    again = shapes.register_env(buffer.register_env(env_request(group_size=4)))
    assert again["env_id"] == 1 and again["checkpoint_dir"] == "/new" and again["starting_step"] == 4


def test_register_rejects_batch_size_below_one(buffer: ExperienceBuffer) -> None:
    with pytest.raises(InvalidInput) as err:
        buffer.register_trainer(registration(batch_size=0))
    assert err.value.field == "batch_size"
    assert shapes.info(buffer.run)["batch_size"] == -1


# ------------------------------------------------------------------------------------------ environments


def test_register_env_waits_until_the_trainer_started(buffer: ExperienceBuffer) -> None:
    assert shapes.register_env(buffer.register_env(env_request())) == {"status": "wait for trainer to start"}
    buffer.register_trainer(registration())
    assert shapes.register_env(buffer.register_env(env_request())) == {"status": "wait for trainer to start"}
    buffer.mark_started()
    answer = shapes.register_env(buffer.register_env(env_request()))
    assert answer == {
        "status": "success",
        "env_id": 0,  # the waiting calls registered nothing
        "wandb_name": "env_0",
        "checkpoint_dir": "/ckpt",
        "starting_step": 0,
        "checkpoint_interval": 10,
        "num_steps": 100,
    }


def test_register_env_reports_the_current_step(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=2, starting_step=5)
    env = shapes.register_env(buffer.register_env(env_request(group_size=2)))
    assert env["starting_step"] == 5
    buffer.ingest([make_group([1, 2], env_id=0)])
    buffer.next_batch()
    assert shapes.register_env(buffer.register_env(env_request(group_size=2)))["starting_step"] == 6


def test_wandb_names_count_earlier_envs_of_the_same_name(buffer: ExperienceBuffer) -> None:
    started(buffer)
    names = [buffer.register_env(env_request(name=n)).env.wandb_name for n in ["gsm", "math", "gsm", "gsm", "math"]]
    assert names == ["gsm_0", "math_0", "gsm_1", "gsm_2", "math_1"]


def test_env_ids_are_never_reused(buffer: ExperienceBuffer) -> None:
    started(buffer)
    ids = [shapes.register_env(buffer.register_env(env_request()))["env_id"] for _ in range(3)]
    buffer.disconnect_env(1)
    buffer.disconnect_env(2)
    ids.append(shapes.register_env(buffer.register_env(env_request()))["env_id"])
    assert ids == [0, 1, 2, 3]
    # a disconnected env's name still counts, as in 0.4.0
    assert shapes.register_env(buffer.register_env(env_request()))["wandb_name"] == "env_4"


def test_disconnect_unknown_env_raises_naming_the_env(buffer: ExperienceBuffer) -> None:
    started(buffer)
    with pytest.raises(UnknownEnv) as err:
        buffer.disconnect_env(0)
    assert err.value.field == "env_id" and "env_id 0 is not registered" in err.value.message
    buffer.register_env(env_request())
    for env_id in (-1, 1):
        with pytest.raises(UnknownEnv):
            buffer.disconnect_env(env_id)
    buffer.disconnect_env(0)
    assert [e.connected for e in buffer.envs] == [False]


@pytest.mark.parametrize(
    ("field", "value"),
    [("group_size", 0), ("weight", -1.0), ("weight", float("nan")), ("min_batch_allocation", 1.5)],
)
def test_register_env_rejects_values_that_cannot_work(buffer: ExperienceBuffer, field: str, value: Any) -> None:
    started(buffer)
    req = dataclasses.replace(env_request(), **{field: value})
    with pytest.raises(InvalidInput) as err:
        buffer.register_env(req)
    assert err.value.field == field
    assert shapes.register_env(buffer.register_env(env_request()))["env_id"] == 0


def test_ingest_with_unknown_env_id_is_rejected_and_stores_nothing(buffer: ExperienceBuffer) -> None:
    started(buffer)
    buffer.register_env(env_request(group_size=2))
    with pytest.raises(InvalidInput) as err:
        buffer.ingest([make_group([1, 2], env_id=0), make_group([3, 4], env_id=1)])
    assert err.value.field == "env_id"
    assert buffer.status().queue_size == 0


def test_status_env_for_unknown_env_raises(buffer: ExperienceBuffer) -> None:
    started(buffer)
    with pytest.raises(UnknownEnv):
        buffer.status_env(0)
    buffer.register_env(env_request())
    with pytest.raises(UnknownEnv):
        buffer.status_env(1)
    with pytest.raises(UnknownEnv):
        buffer.status_env(-1)


def test_status_env_without_a_connected_env_raises(buffer: ExperienceBuffer) -> None:
    started(buffer)
    buffer.register_env(env_request())
    buffer.disconnect_env(0)
    with pytest.raises(NotRegistered):
        buffer.status_env(0)


# ------------------------------------------------------------------------------------------ status


def test_status_counts_queued_groups(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=8)
    buffer.register_env(env_request(group_size=4))
    buffer.ingest([make_group([1, 2, 3, 4], env_id=0), make_group([5, 6, 7, 8], env_id=0)])
    buffer.ingest([make_group([9, 10])])  # no env: queued as is
    buffer.ingest([make_group([11], env_id=0)])  # held
    status = buffer.status()
    assert status.queue_size == 3
    assert status.queued_sequences == 10
    assert status.held_sequences == 1
    assert status.current_step == 0


# Hand-computed 0.4.0 status-env answers. batch_size 8; env0 (group 4, 512 tokens, weight 1, min 0.25),
# env1 (group 2, 256 tokens, weight 2), env2 (group 1, 1024 tokens, weight 0.5); every env weighs 1/3.
# Queue: env0 4 seqs, env1 6 seqs, env2 3 seqs, no env 2 seqs; largest group 4.
# Others round up to packs of 4, less their minimum (env0: int(8 * 0.25) = 2).
#   env0: own 4; env1 8 + env2 4 + none 4 = 16 -> (4 + 16) // 4 = 5; self 1
#   env1: own 6; env0 4-2 + env2 4 + none 4 = 10 -> 16 // 2 = 8; self 3
#   env2: own 3; env0 2 + env1 8 + none 4 = 14 -> 17 // 1 = 17; self 3
STATUS_ENV_EXPECTED = {0: (5, 1), 1: (8, 3), 2: (17, 3)}


def _mixed_queue(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=8)
    buffer.register_env(env_request(group_size=4, max_token_length=512, min_batch_allocation=0.25))
    buffer.register_env(env_request(group_size=2, max_token_length=256, weight=2.0))
    buffer.register_env(env_request(group_size=1, max_token_length=1024, weight=0.5))
    tags = Tags()
    buffer.ingest([make_group(tags.take(2), env_id=1)])
    buffer.ingest([make_group(tags.take(1), env_id=2)])
    buffer.ingest([make_group(tags.take(4), env_id=0)])
    buffer.ingest([make_group(tags.take(2))])
    buffer.ingest([make_group(tags.take(2), env_id=1), make_group(tags.take(1), env_id=2)])
    buffer.ingest([make_group(tags.take(1), env_id=2), make_group(tags.take(2), env_id=1)])


def test_status_env_matches_hand_computed_0_4_0_answers(buffer: ExperienceBuffer) -> None:
    _mixed_queue(buffer)
    for env_id, (queue_size, self_queue_size) in STATUS_ENV_EXPECTED.items():
        status = buffer.status_env(env_id)
        assert status.queue_size == queue_size, env_id
        assert status.self_queue_size == self_queue_size, env_id
        assert status.max_group_size == 4
        assert status.unallocated_fraction == pytest.approx(0.75)
        assert status.env_weight == pytest.approx(1 / 3)
        assert status.current_step == 0


def test_status_env_weights_follow_connected_envs_with_a_floor(buffer: ExperienceBuffer) -> None:
    started(buffer)
    buffer.register_env(env_request(max_token_length=1000, weight=1.0, min_batch_allocation=0.5))
    buffer.register_env(env_request(max_token_length=1000, weight=3.0, min_batch_allocation=0.75))
    buffer.register_env(env_request(max_token_length=1000, weight=0.0))
    assert shapes.status_env(buffer.status_env(0))["env_weight"] == pytest.approx(0.25)
    assert shapes.status_env(buffer.status_env(1))["env_weight"] == pytest.approx(0.75)
    assert shapes.status_env(buffer.status_env(2))["env_weight"] == pytest.approx(0.01)
    assert shapes.status_env(buffer.status_env(0))["unallocated_fraction"] == pytest.approx(0.0)  # minimums sum past 1
    buffer.disconnect_env(1)
    assert shapes.status_env(buffer.status_env(0))["env_weight"] == pytest.approx(1.0)
    assert shapes.status_env(buffer.status_env(0))["unallocated_fraction"] == pytest.approx(0.5)


def test_status_env_on_an_empty_queue(buffer: ExperienceBuffer) -> None:
    started(buffer)
    buffer.register_env(env_request(group_size=4))
    status = buffer.status_env(0)
    assert status.queue_size == 0 and status.self_queue_size == 0
    assert status.max_group_size == 1 and status.unallocated_fraction == 1.0


def _reference_status_env(buffer: ExperienceBuffer, env_id: int) -> dict[str, Any]:
    """Run 0.4.0's own ``get_status_env`` on the same envs and queue."""
    server = pytest.importorskip("atroposlib.api.server", reason="atroposlib 0.4.0 is not installed")
    batch_size, step = shapes.info(buffer.run)["batch_size"], buffer.status().current_step
    return reference_status_env(server, buffer, env_id, batch_size=batch_size, step=step)


def test_status_env_equals_0_4_0_on_mixed_queues(buffer: ExperienceBuffer) -> None:
    _mixed_queue(buffer)
    for step in range(3):
        for env_id in range(3):
            expected = _reference_status_env(buffer, env_id)
            assert shapes.status_env(buffer.status_env(env_id)) == pytest.approx(expected), (step, env_id)
        buffer.next_batch()
    buffer.disconnect_env(0)
    for env_id in range(3):
        assert shapes.status_env(buffer.status_env(env_id)) == pytest.approx(_reference_status_env(buffer, env_id))


# ------------------------------------------------------------------------------------------ mixed sizes


def test_smaller_groups_are_held_then_merged_into_one_group(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=4)
    buffer.register_env(env_request(group_size=4))
    assert scored(buffer.ingest([make_group([1], env_id=0)])) == [{"status": "buffered", "buffer_size": 1}]
    assert scored(buffer.ingest([make_group([2, 3], env_id=0)])) == [{"status": "buffered", "buffer_size": 3}]
    assert buffer.status().queue_size == 0
    assert buffer.next_batch() is None
    # 1 + 2 + 1 = 4: merged into one queued group of four; nothing held any more
    assert scored(buffer.ingest([make_group([4], env_id=0)])) == [{"status": "buffered", "buffer_size": 0}]
    assert buffer.status().queue_size == 1
    assert [e.size for e in buffer.queued()] == [4]
    batch = buffer.next_batch()
    assert batch is not None and len(batch.items) == 1
    assert served_tokens(batch) == [1, 2, 3, 4]
    assert batch.items[0].env_id == 0


def test_merge_picks_a_combination_that_sums_exactly(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=8)
    buffer.register_env(env_request(group_size=8))
    buffer.ingest([make_group([1, 2, 3], env_id=0)])
    buffer.ingest([make_group([4, 5, 6, 7, 8, 9], env_id=0)])  # 3 + 6 > 8: both held
    assert buffer.held_sequences(0) == 9
    out = scored(buffer.ingest([make_group([10, 11], env_id=0)]))  # 6 + 2 = 8
    assert out == [{"status": "buffered", "buffer_size": 3}]
    batch = buffer.next_batch()
    assert batch is not None and sorted(served_tokens(batch)) == [4, 5, 6, 7, 8, 9, 10, 11]


def test_held_groups_of_one_request_merge(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=4)
    buffer.register_env(env_request(group_size=4))
    out = scored(buffer.ingest([make_group([1, 2], env_id=0), make_group([3, 4], env_id=0)]))
    assert out == [{"status": "buffered", "buffer_size": 2}, {"status": "buffered", "buffer_size": 0}]
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [1, 2, 3, 4]


def test_held_groups_are_kept_per_env(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=4)
    buffer.register_env(env_request(group_size=4))
    buffer.register_env(env_request(group_size=4))
    buffer.ingest([make_group([1, 2], env_id=0), make_group([3, 4], env_id=1)])
    assert buffer.status().queue_size == 0
    assert buffer.held_sequences(0) == 2 and buffer.held_sequences(1) == 2


def test_group_larger_than_group_size_is_rejected(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=4)
    buffer.register_env(env_request(group_size=2))
    with pytest.raises(InvalidInput):
        buffer.ingest([make_group([1, 2], env_id=0), make_group([3, 4, 5], env_id=0)])
    status = buffer.status()
    assert status.queue_size == 0 and status.held_sequences == 0


# ------------------------------------------------------------------------------------------ batches


def test_no_batch_until_enough_sequences(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=8)
    buffer.ingest([make_group([1, 2, 3, 4])])
    assert buffer.next_batch() is None
    assert buffer.status().current_step == 0
    buffer.ingest([make_group([5, 6, 7, 8])])
    batch = buffer.next_batch()
    assert batch is not None and batch.step == 0 and batch.sequences == 8
    assert buffer.status().current_step == 1


def test_batches_are_served_oldest_first_and_count_one_step_each(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=4, starting_step=10)
    tags = Tags()
    for _ in range(6):
        buffer.ingest([make_group(tags.take(2))])
    first, second, third = buffer.next_batch(), buffer.next_batch(), buffer.next_batch()
    assert first is not None and second is not None and third is not None
    assert (served_tokens(first), served_tokens(second), served_tokens(third)) == (
        [1, 2, 3, 4],
        [5, 6, 7, 8],
        [9, 10, 11, 12],
    )
    assert [first.step, second.step, third.step] == [10, 11, 12]
    assert buffer.next_batch() is None
    assert buffer.status().current_step == 13


def test_heterogeneous_sizes_pack_to_the_largest_group(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=8)
    buffer.ingest([make_group([1])])
    buffer.ingest([make_group([2, 3, 4, 5])])
    buffer.ingest([make_group([6, 7])])
    buffer.ingest([make_group([8])])
    # only one pack of 4 is complete: no batch of 8 yet, and nothing is split
    assert buffer.next_batch() is None
    buffer.ingest([make_group([9, 10])])
    buffer.ingest([make_group([11])])
    buffer.ingest([make_group([12])])
    batch = buffer.next_batch()
    assert batch is not None
    assert sorted(served_tokens(batch)) == [2, 3, 4, 5, 6, 7, 9, 10]
    assert [item.size for item in batch.items] == [4, 2, 2]
    assert sorted(t for e in buffer.queued() for t in [e.size]) == [1, 1, 1, 1]


def test_batch_items_are_the_stored_groups(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=2)
    buffer.register_env(env_request(group_size=2))
    sent = make_group([7, 8], env_id=0, policy_version=3)
    sent.meta["messages"] = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    buffer.ingest([sent])
    batch = buffer.next_batch()
    assert batch is not None
    got = batch.items[0]
    assert got.env_id == 0 and got.policy_version == 3
    assert got.meta == sent.meta
    assert got.scores.tolist() == sent.scores.tolist()
    assert [r.tolist() for r in got.masks.rows()] == [[7, 7], [8, 8]]


# ------------------------------------------------------------------------------------------ minimums


def test_minimum_allocation_reserves_part_of_every_batch(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=8)
    buffer.register_env(env_request(group_size=2))
    buffer.register_env(env_request(group_size=2, min_batch_allocation=0.5))
    tags = Tags()
    for _ in range(8):
        buffer.ingest([make_group(tags.take(2), env_id=0)])
    buffer.ingest([make_group(tags.take(2), env_id=1)])
    # env 1 has only 2 sequences: it still gets them, the rest is filled in queue order
    batch = buffer.next_batch()
    assert batch is not None
    by_env = [item.env_id for item in batch.items]
    assert by_env.count(1) == 1 and batch.sequences == 8
    # env 1 has nothing left: its minimum cannot be met, so no batch
    assert buffer.next_batch() is None
    for _ in range(2):
        buffer.ingest([make_group(tags.take(2), env_id=1)])
    batch = buffer.next_batch()
    assert batch is not None and [item.env_id for item in batch.items].count(1) == 2


def test_minimum_of_a_disconnected_env_is_ignored(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=4)
    buffer.register_env(env_request(group_size=2))
    buffer.register_env(env_request(group_size=2, min_batch_allocation=0.5))
    buffer.ingest([make_group([1, 2], env_id=0), make_group([3, 4], env_id=0)])
    assert buffer.next_batch() is None
    buffer.disconnect_env(1)
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------ staleness


def test_stale_items_are_never_served_and_are_counted_per_env(make_buffer: MakeBuffer) -> None:
    buffer = started(make_buffer(max_staleness=1), batch_size=2)
    buffer.register_env(env_request(group_size=2))
    buffer.register_env(env_request(group_size=2))
    for v in range(3):  # steps 0, 1, 2: fresh data at every step
        buffer.ingest([make_group([100 + 2 * v, 101 + 2 * v], policy_version=v)])
        assert buffer.next_batch() is not None
    assert buffer.status().current_step == 3
    buffer.ingest([make_group([1, 2], env_id=0, policy_version=1)])  # 1 < 3 - 1: stale
    buffer.ingest([make_group([3, 4], env_id=1, policy_version=0)])  # stale
    buffer.ingest([make_group([5, 6], env_id=1, policy_version=1)])  # stale
    buffer.ingest([make_group([7, 8], env_id=0, policy_version=2)])  # 2 == 3 - 1: still fresh
    buffer.ingest([make_group([9, 10], env_id=0)])  # no version: never stale
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [7, 8]
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [9, 10]
    assert buffer.next_batch() is None
    assert buffer.status().stale_dropped == {"0": 1, "1": 2}


def test_without_max_staleness_old_items_are_served(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=2, starting_step=50)
    buffer.ingest([make_group([1, 2], policy_version=0)])
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [1, 2]
    assert buffer.status().stale_dropped == {}


# ------------------------------------------------------------------------------------------ backpressure


def test_queue_full_refuses_the_whole_request_and_recovers(make_buffer: MakeBuffer) -> None:
    buffer = started(make_buffer(max_queued_sequences=8, retry_after_s=2.5), batch_size=4)
    buffer.register_env(env_request(group_size=4))
    buffer.ingest([make_group([1, 2, 3, 4], env_id=0)])
    buffer.ingest([make_group([5, 6], env_id=0)])  # held sequences count too
    with pytest.raises(QueueFull) as err:
        buffer.ingest([make_group([7, 8], env_id=0), make_group([9, 10, 11, 12], env_id=0)])
    assert err.value.retry_after_s == 2.5
    assert buffer.status().queued_sequences == 4 and buffer.status().held_sequences == 2
    buffer.ingest([make_group([7, 8], env_id=0)])  # exactly at the bound: accepted (and merged)
    with pytest.raises(QueueFull):
        buffer.ingest([make_group([13])])
    batch = buffer.next_batch()
    assert batch is not None and served_tokens(batch) == [1, 2, 3, 4]
    buffer.ingest([make_group([13, 14, 15, 16], env_id=0)])
    # nothing accepted was evicted
    served = [served_tokens(buffer.next_batch()), served_tokens(buffer.next_batch())]
    assert served == [[5, 6, 7, 8], [13, 14, 15, 16]]


def test_queue_full_applies_to_items_put_in_the_table(open_storage: Callable[[], Storage], clock: Any) -> None:
    table = Table(open_storage(), BufferConfig(max_queued_sequences=2), clock=clock)
    table.register_trainer(registration(2))
    table.put(make_group([1, 2]), size=2)
    with pytest.raises(QueueFull):
        table.put(make_group([3]), size=1)
    batch = table.next_batch()
    assert batch is not None and served_tokens(batch) == [1, 2]


# ------------------------------------------------------------------------------------------ leases


def test_acked_lease_is_never_served_again(buffer: ExperienceBuffer, clock: Any) -> None:
    started(buffer, batch_size=2)
    buffer.ingest([make_group([1, 2]), make_group([3, 4])])
    batch = buffer.next_batch(lease_s=10)
    assert batch is not None and batch.batch_id is not None and batch.step == 0
    assert buffer.status().leased_batches == 1
    buffer.ack(batch.batch_id)
    assert buffer.status().leased_batches == 0
    clock.advance(100)
    nxt = buffer.next_batch()
    assert nxt is not None and served_tokens(nxt) == [3, 4] and nxt.step == 1
    assert buffer.next_batch() is None
    with pytest.raises(UnknownBatch):
        buffer.ack(batch.batch_id)


def test_expired_lease_is_served_again_whole_first_as_the_same_step(buffer: ExperienceBuffer, clock: Any) -> None:
    started(buffer, batch_size=2)
    buffer.ingest([make_group([1, 2]), make_group([3, 4]), make_group([5, 6])])
    first = buffer.next_batch(lease_s=10)
    assert first is not None and first.batch_id is not None
    clock.advance(5)
    assert buffer.status().leased_batches == 1
    clock.advance(6)
    assert buffer.status().leased_batches == 0
    again = buffer.next_batch(lease_s=10)
    assert again is not None
    assert served_tokens(again) == [1, 2] and again.step == 0 and again.batch_id != first.batch_id
    assert buffer.status().current_step == 1
    with pytest.raises(UnknownBatch):
        buffer.ack(first.batch_id)
    buffer.ack(again.batch_id)  # type: ignore[arg-type]
    rest = buffer.next_batch()
    assert rest is not None and served_tokens(rest) == [3, 4] and rest.step == 1


def test_late_ack_before_redelivery_still_consumes_the_batch(buffer: ExperienceBuffer, clock: Any) -> None:
    started(buffer, batch_size=2)
    buffer.ingest([make_group([1, 2]), make_group([3, 4])])
    leased = buffer.next_batch(lease_s=10)
    assert leased is not None and leased.batch_id is not None
    clock.advance(60)
    assert buffer.status().leased_batches == 0  # expired, not yet served again
    buffer.ack(leased.batch_id)
    rest = buffer.next_batch()
    assert rest is not None and served_tokens(rest) == [3, 4] and rest.step == 1
    assert buffer.next_batch() is None


def test_unleased_batch_is_gone_once_served(buffer: ExperienceBuffer, clock: Any) -> None:
    started(buffer, batch_size=2)
    buffer.ingest([make_group([1, 2])])
    batch = buffer.next_batch()
    assert batch is not None and batch.batch_id is None
    clock.advance(1e6)
    assert buffer.next_batch() is None


def test_ack_of_unknown_batch_raises(buffer: ExperienceBuffer) -> None:
    started(buffer)
    with pytest.raises(UnknownBatch):
        buffer.ack("no-such-batch")


def test_lease_must_be_positive(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=2)
    buffer.ingest([make_group([1, 2])])
    with pytest.raises(InvalidInput):
        buffer.next_batch(lease_s=0)
    assert buffer.status().queue_size == 1


# ------------------------------------------------------------------------------------------ latest / reset


def test_latest_example_is_the_last_queued_group(buffer: ExperienceBuffer) -> None:
    started(buffer, batch_size=4)
    assert buffer.latest_example() is None
    buffer.register_env(env_request(group_size=2))
    buffer.ingest([make_group([1, 2], env_id=0)])
    buffer.ingest([make_group([3], env_id=0)])  # held, not queued
    latest = buffer.latest_example()
    assert [int(r[0]) for r in latest.tokens.rows()] == [1, 2]
    buffer.ingest([make_group([4], env_id=0)])  # merged: the merged group is the latest
    latest = buffer.latest_example()
    assert [int(r[0]) for r in latest.tokens.rows()] == [3, 4]


def test_reset_clears_everything(buffer: ExperienceBuffer, clock: Any) -> None:
    started(buffer, batch_size=2, starting_step=4)
    buffer.register_env(env_request(group_size=2))
    buffer.ingest([make_group([1, 2], env_id=0), make_group([3], env_id=0), make_group([5, 6], env_id=0)])
    leased = buffer.next_batch(lease_s=5)
    assert leased is not None
    buffer.reset()
    assert shapes.info(buffer.run) == {"batch_size": -1, "max_token_len": -1}
    assert shapes.wandb_info(buffer.run) == {"group": None, "project": None}
    status = buffer.status()
    assert (status.current_step, status.queue_size, status.held_sequences) == (0, 0, 0)
    assert status.leased_batches == 0
    assert buffer.latest_example() is None
    with pytest.raises(NotRegistered):
        buffer.next_batch()
    assert shapes.register_env(buffer.register_env(env_request())) == {"status": "wait for trainer to start"}
    started(buffer, batch_size=2)
    assert shapes.register_env(buffer.register_env(env_request(group_size=2)))["env_id"] == 0
    clock.advance(100)  # the old lease must not come back
    assert buffer.next_batch() is None
    with pytest.raises(UnknownBatch):
        buffer.ack(leased.batch_id)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ restart


def test_restart_restores_queue_held_leases_registration_envs_and_step(make_buffer: MakeBuffer, clock: Any) -> None:
    buffer = started(make_buffer(), batch_size=4, starting_step=2)
    buffer.register_env(env_request(group_size=4, name="a"))
    buffer.register_env(env_request(group_size=2, name="a", min_batch_allocation=0.5))
    buffer.disconnect_env(1)
    tags = Tags()
    buffer.ingest([make_group(tags.take(4), env_id=0)])  # 1..4
    buffer.ingest([make_group(tags.take(4), env_id=0)])  # 5..8
    buffer.ingest([make_group(tags.take(4), env_id=0)])  # 9..12
    buffer.ingest([make_group(tags.take(1), env_id=0)])  # 13, held
    leased = buffer.next_batch(lease_s=10)
    acked = buffer.next_batch(lease_s=10)
    assert leased is not None and acked is not None and acked.batch_id is not None
    buffer.ack(acked.batch_id)

    restarted = make_buffer()
    assert shapes.info(restarted.run) == {"batch_size": 4, "max_token_len": 2048}
    assert shapes.wandb_info(restarted.run) == {"group": "group", "project": "project"}
    status = restarted.status()
    assert (status.current_step, status.queue_size, status.held_sequences) == (4, 1, 1)
    assert status.leased_batches == 1
    assert [e.connected for e in restarted.envs] == [True, False]
    # started survives: envs register at once, and names and ids continue
    env = shapes.register_env(restarted.register_env(env_request(group_size=4, name="a")))
    assert (env["env_id"], env["wandb_name"], env["starting_step"]) == (2, "a_2", 4)
    # the held group still merges
    restarted.ingest([make_group(tags.take(3), env_id=0)])  # 14..16
    assert restarted.held_sequences() == 0
    with pytest.raises(UnknownBatch):
        restarted.ack(acked.batch_id)
    # the open lease expires and comes back first, as the same step
    clock.advance(11)
    again = restarted.next_batch()
    assert again is not None and served_tokens(again) == [1, 2, 3, 4] and again.step == 2
    rest = restarted.next_batch()
    assert rest is not None and served_tokens(rest) == [9, 10, 11, 12] and rest.step == 4
    last = restarted.next_batch()
    assert last is not None and served_tokens(last) == [13, 14, 15, 16]
    assert restarted.next_batch() is None


def test_restart_keeps_an_open_lease_ackable(make_buffer: MakeBuffer) -> None:
    buffer = started(make_buffer(), batch_size=2)
    buffer.ingest([make_group([1, 2]), make_group([3, 4])])
    leased = buffer.next_batch(lease_s=30)
    assert leased is not None and leased.batch_id is not None
    restarted = make_buffer()
    restarted.ack(leased.batch_id)
    rest = restarted.next_batch()
    assert rest is not None and served_tokens(rest) == [3, 4]
    assert make_buffer().next_batch() is None


def test_restart_after_reset_stays_reset(make_buffer: MakeBuffer) -> None:
    buffer = started(make_buffer(), batch_size=2)
    buffer.register_env(env_request(group_size=2))
    buffer.ingest([make_group([1, 2], env_id=0)])
    buffer.reset()
    restarted = make_buffer()
    assert shapes.info(restarted.run)["batch_size"] == -1
    assert restarted.status().queue_size == 0
    assert restarted.envs == []


def test_restart_keeps_stale_counts(make_buffer: MakeBuffer) -> None:
    buffer = started(make_buffer(max_staleness=0), batch_size=2, starting_step=5)
    buffer.ingest([make_group([1, 2], policy_version=4), make_group([3, 4], policy_version=5)])
    assert served_tokens(buffer.next_batch()) == [3, 4]
    assert make_buffer(max_staleness=0).status().stale_dropped == {"None": 1}


def test_a_write_the_backend_refuses_leaves_buffer_and_storage_usable(
    make_buffer: MakeBuffer, storage_url: str
) -> None:
    buffer = started(make_buffer(), batch_size=2)
    too_big = make_group([1, 2], policy_version=2**63)  # over SQLite's INTEGER (the server refuses it first)
    if storage_url == "memory":
        buffer.ingest([too_big])
    else:
        with pytest.raises(OverflowError):
            buffer.ingest([too_big])
    buffer.ingest([make_group([3, 4])])
    expected = ([[1, 2]] if storage_url == "memory" else []) + [[3, 4]]
    assert [e.size for e in buffer.queued()] == [2] * len(expected)
    restarted = make_buffer()
    assert [served_tokens(restarted.next_batch()) for _ in expected] == expected
    assert restarted.next_batch() is None


def test_sqlite_refuses_payloads_it_cannot_store(tmp_path) -> None:
    from rollhub.buffer import make_storage
    from rollhub.errors import ConfigError

    table = Table(make_storage(f"sqlite:///{tmp_path / 'x.db'}", GROUP_CODEC))
    with pytest.raises(ConfigError, match="memory backend"):
        table.put({"not": "a group"}, size=1)
    assert table.status().queue_size == 0


def test_damaged_sqlite_item_is_a_storage_error(tmp_path) -> None:
    import sqlite3

    from rollhub.buffer import ExperienceBuffer, make_storage
    from rollhub.errors import StorageError
    from rollhub.wire.group import group_from_json

    path = tmp_path / "x.db"
    buffer = ExperienceBuffer(make_storage(f"sqlite:///{path}", GROUP_CODEC))
    buffer.ingest([group_from_json({"tokens": [[1]], "masks": [[1]], "scores": [1.0]})])
    with sqlite3.connect(path) as db:
        db.execute("UPDATE items SET payload = x'c1c1'")
    with pytest.raises(StorageError, match="damaged"):
        buffer.storage.payloads([buffer.queued()[0].gid])
