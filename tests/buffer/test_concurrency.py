"""The buffer under concurrent producers and consumers (threads), on both backends.

Producers ingest tagged groups (some smaller than the env's group size, so held and merged) while consumers
pull batches, some leased and acknowledged. Every accepted sequence must be consumed exactly once and every
batch must be whole. No timing is asserted; the threads only race.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from buffer_support import env_request, make_group, registration, served_tokens

from rollhub.buffer import ExperienceBuffer

PRODUCERS = 4
GROUPS_EACH = 40
BATCH_SIZE = 8


def test_concurrent_ingest_and_pull_serve_every_sequence_once(make_buffer: Callable[..., ExperienceBuffer]) -> None:
    buffer = make_buffer()
    buffer.register_trainer(registration(BATCH_SIZE))
    buffer.mark_started()
    buffer.register_env(env_request(group_size=4))
    consumed: list[list[int]] = []
    errors: list[BaseException] = []
    done = threading.Event()
    lock = threading.Lock()

    def produce(worker: int) -> None:
        try:
            for i in range(GROUPS_EACH):
                base = (worker * GROUPS_EACH + i) * 4 + 1
                if i % 4 == 0:  # two halves: held, then merged into one group
                    buffer.ingest([make_group([base, base + 1], env_id=0)])
                    buffer.ingest([make_group([base + 2, base + 3], env_id=0)])
                else:
                    buffer.ingest([make_group([base, base + 1, base + 2, base + 3], env_id=0)])
        except BaseException as exc:  # surfaced below, in the test thread
            errors.append(exc)

    def consume(leased: bool) -> None:
        try:
            while True:
                finished = done.is_set()
                batch = buffer.next_batch(lease_s=60 if leased else None, wait_s=0.01)
                if batch is None:
                    if finished:
                        return
                    continue
                tags = served_tokens(batch)
                assert len(tags) == BATCH_SIZE
                if leased:
                    buffer.ack(batch.batch_id)  # type: ignore[arg-type]
                with lock:
                    consumed.append(tags)
        except BaseException as exc:
            errors.append(exc)

    producers = [threading.Thread(target=produce, args=(w,)) for w in range(PRODUCERS)]
    consumers = [threading.Thread(target=consume, args=(leased,)) for leased in (False, True)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join()
    done.set()
    for t in consumers:
        t.join()
    assert not errors, errors
    tags = [t for batch in consumed for t in batch]
    total = PRODUCERS * GROUPS_EACH * 4
    assert sorted(tags) == list(range(1, total + 1))
    assert buffer.status().current_step == total // BATCH_SIZE
    assert buffer.held_sequences() == 0 and buffer.status().queue_size == 0
