"""HttpWriter against a real ``rollhub serve`` child process on a free loopback port."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tests.conftest import ServerProcess

from rollhub.client.trainer import TrainerClient
from rollhub.curriculum import CurriculumConfig, LessonConfig
from rollhub.demos.serve import ChildServer, start_server
from rollhub.errors import QueueFull
from rollhub.inference.tokenizer import CharTokenizer
from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer, TransformerConfig
from rollhub.rollout.group_manager import GroupRolloutManager
from rollhub.rollout.http_writer import HttpWriter, WriterError
from rollhub.rollout_types import RolloutBatch

torch.set_num_threads(1)


@pytest.fixture
def manager() -> GroupRolloutManager:
    torch.manual_seed(0)
    tok = CharTokenizer()
    policy = LocalPolicy(TinyTransformer(TransformerConfig(vocab_size=tok.vocab_size, d_model=16, n_heads=2)), tok)
    lesson = LessonConfig("easy", "mock", {"name": "easy"}, n_examples=2, n_generations=3)
    return GroupRolloutManager(CurriculumConfig(lessons=(lesson,)), policy)


def batch(manager: GroupRolloutManager, weight_step: int, n_examples: int = 2) -> RolloutBatch:
    out, _ = manager.sample_batch("easy", n_examples, 3, "train", weight_step, weight_step, "w0")
    assert out is not None
    return out


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ChildServer]:
    handle = start_server(f"sqlite:///{tmp_path / 'rollhub.db'}", "--max-queued-sequences", "12")
    yield handle
    handle.stop()


def test_batches_arrive_as_items_with_env_id_and_policy_version_over_msgpack(
    server: ChildServer, manager: GroupRolloutManager
) -> None:
    writer = HttpWriter(server.url, "mock", group_size=3, max_token_length=16, register_timeout_s=20.0)
    writer = pickle.loads(pickle.dumps(writer))  # as shipped to a Ray worker
    registered: list[int] = []
    thread = threading.Thread(target=lambda: registered.append(writer.register()))
    thread.start()  # registration waits (retrying) until the trainer has started
    time.sleep(0.5)
    assert registered == []
    trainer = TrainerClient(server.url)
    trainer.register(batch_size=6, max_token_len=16, num_steps=10)
    assert trainer.get_batch() is None  # the trainer has started: envs may register now
    thread.join(timeout=20.0)
    assert registered == [writer.env_id]
    sent = [batch(manager, 4), batch(manager, 5)]
    writer.write(sent)
    assert writer.client.binary is True and writer.groups_sent == 4  # the server took msgpack bodies
    served = []
    for _ in range(2):
        got = trainer.get_batch(wait_s=5.0)
        assert got is not None
        served.extend(got)
    assert len(served) == 4
    for group, expected in zip(served, [it for b in sent for it in b.to_items()], strict=True):
        assert group.env_id == writer.env_id
        assert group.policy_version == expected["policy_version"]
        assert [row.tolist() for row in group.tokens.rows()] == expected["tokens"]
        assert group.scores.tolist() == expected["scores"]
        assert group.meta["group_overrides"]["rollhub"]["worker_id"] == "w0"
    assert [g.policy_version for g in served] == [4, 4, 5, 5]
    writer.close()
    trainer.close()


def test_a_full_queue_is_queue_full_with_the_accepted_count_and_nothing_is_lost(
    server: ChildServer, manager: GroupRolloutManager
) -> None:
    trainer = TrainerClient(server.url)
    trainer.register(batch_size=6, max_token_len=16, num_steps=10)
    assert trainer.get_batch() is None
    writer = HttpWriter(server.url, "mock", group_size=3, max_token_length=16)
    batches = [batch(manager, 0), batch(manager, 0), batch(manager, 0)]  # 6 sequences each, bound is 12
    with pytest.raises(QueueFull) as refused:
        writer.write(batches)
    assert refused.value.accepted == 2 and refused.value.retry_after_s > 0  # type: ignore[attr-defined]
    assert trainer.get_batch(wait_s=5.0) is not None  # the trainer takes 6 sequences: room again
    writer.write(batches[refused.value.accepted :])  # type: ignore[attr-defined]
    assert writer.groups_sent == 6
    with pytest.raises(WriterError, match="RolloutBatch"):
        writer.write([{"tokens": [[1]]}])
    writer.close()
    trainer.close()


def test_a_server_that_forgot_the_env_gets_it_registered_again_and_the_batch_resent(
    server_factory: type[ServerProcess], manager: GroupRolloutManager, caplog: pytest.LogCaptureFixture
) -> None:
    first = server_factory("--storage", "memory").start()
    trainer = TrainerClient(first.url)
    trainer.register(batch_size=6, max_token_len=16, num_steps=10)
    assert trainer.get_batch() is None
    writer = HttpWriter(first.url, "mock", group_size=3, max_token_length=16)
    writer.write([batch(manager, 1)])
    first.kill()
    restarted = server_factory("--storage", "memory", port=first.port).start()  # knows no env
    trainer = TrainerClient(restarted.url)
    trainer.register(batch_size=6, max_token_len=16, num_steps=10)
    assert trainer.get_batch() is None
    with caplog.at_level(logging.WARNING, logger="rollhub.client"):
        writer.write([batch(manager, 2)])
    assert "registered again" in caplog.text and writer.groups_sent == 4
    served = trainer.get_batch(wait_s=5.0)
    assert served is not None and [g.policy_version for g in served] == [2, 2]
    assert all(g.env_id == writer.env_id for g in served)
    writer.close()
    trainer.close()
