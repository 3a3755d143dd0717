"""HttpWriter against a real ``rollhub serve`` child process on a free loopback port."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from tests.conftest import ServerProcess

from rollhub.client.trainer import TrainerClient
from rollhub.curriculum import CurriculumConfig, LessonConfig
from rollhub.errors import QueueFull
from rollhub.experience import Group
from rollhub.inference.tokenizer import CharTokenizer
from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer, TransformerConfig
from rollhub.rollout.group.manager import GroupRolloutManager
from rollhub.rollout.protocols import Backlog, SampleRequest
from rollhub.rollout.writers.http_writer import HttpWriter, WriterError
from rollhub.run.child_server import ChildServer, start_server
from rollhub.wire.group import group_to_item

torch.set_num_threads(1)


def register_attempts(url: str) -> int:
    """How many ``POST /register-env`` the server has answered (its request counter in /metrics)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    prefix = 'rollhub_requests_total{method="POST",route="/register-env"'
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith(prefix))


def wait_for_register_attempts(url: str, n: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s  # a generous wait for a condition, not a timing claim
    while register_attempts(url) < n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def manager() -> GroupRolloutManager:
    torch.manual_seed(0)
    tok = CharTokenizer()
    policy = LocalPolicy(TinyTransformer(TransformerConfig(vocab_size=tok.vocab_size, d_model=16, n_heads=2)), tok)
    lesson = LessonConfig("easy", "mock", {"name": "easy"}, n_examples=2, n_generations=3)
    return GroupRolloutManager(CurriculumConfig(lessons=(lesson,)), policy)


def groups(manager: GroupRolloutManager, version: int, n_examples: int = 2) -> list[Group]:
    out = manager.sample_batch(SampleRequest(version, "w0", lesson_id="easy", n_examples=n_examples, seed=version))
    assert len(out.items) == n_examples
    return out.items  # type: ignore[return-value]


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
    assert wait_for_register_attempts(server.url, 3), "the writer keeps trying to register"
    assert registered == [], "no env registers before a trainer has started"
    trainer = TrainerClient(server.url)
    trainer.register(batch_size=6, max_token_len=16, num_steps=10)
    assert trainer.get_batch() is None  # the trainer has started: envs may register now
    thread.join(timeout=20.0)
    assert registered == [writer.env_id]
    sent = groups(manager, 4) + groups(manager, 5)
    expected_items = [group_to_item(g) for g in sent]
    writer.write(sent)
    assert writer.client.binary is True and writer.groups_sent == 4  # the server took msgpack bodies
    served = []
    for _ in range(2):
        got = trainer.get_batch(wait_s=5.0)
        assert got is not None
        served.extend(got)
    assert len(served) == 4
    for group, expected in zip(served, expected_items, strict=True):
        assert group.env_id == writer.env_id
        assert group.policy_version == expected["policy_version"]
        assert [row.tolist() for row in group.tokens.rows()] == [row.tolist() for row in expected["tokens"]]
        assert group.scores.tolist() == expected["scores"].tolist()
        assert group.meta["group_overrides"]["rollhub"]["worker_id"] == "w0"
    assert [g.policy_version for g in served] == [4, 4, 5, 5]
    assert writer.backlog() == Backlog(0, None)  # this trainer never published a version
    writer.write(groups(manager, 6))
    assert writer.backlog().queued == 2  # the groups waiting to be served: what admission control reads
    assert trainer.get_batch(wait_s=5.0) is not None and writer.backlog().queued == 0
    trainer.publish_version(7)
    assert writer.backlog() == Backlog(0, 7, 7)
    writer.write(groups(manager, 8))
    assert trainer.get_batch(wait_s=5.0) is not None  # the trainer learns from it at 7: the next batch is at 8
    assert writer.backlog() == Backlog(0, 7, 8)
    writer.close()
    trainer.close()


def test_a_full_queue_is_queue_full_with_the_accepted_count_and_nothing_is_lost(
    server: ChildServer, manager: GroupRolloutManager
) -> None:
    trainer = TrainerClient(server.url)
    trainer.register(batch_size=6, max_token_len=16, num_steps=10)
    assert trainer.get_batch() is None
    writer = HttpWriter(server.url, "mock", group_size=3, max_token_length=16, groups_per_request=2)
    sent = groups(manager, 0, n_examples=6)  # 3 sequences each, 6 a request, bound is 12
    with pytest.raises(QueueFull) as refused:
        writer.write(sent)
    assert refused.value.accepted == 4 and refused.value.retry_after_s > 0  # type: ignore[attr-defined]
    assert trainer.get_batch(wait_s=5.0) is not None  # the trainer takes 6 sequences: room again
    writer.write(sent[refused.value.accepted :])  # type: ignore[attr-defined]
    assert writer.groups_sent == 6
    with pytest.raises(WriterError, match="Group objects"):
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
    writer.write(groups(manager, 1))
    first.kill()
    restarted = server_factory("--storage", "memory", port=first.port).start()  # knows no env
    trainer = TrainerClient(restarted.url)
    trainer.register(batch_size=6, max_token_len=16, num_steps=10)
    assert trainer.get_batch() is None
    with caplog.at_level(logging.WARNING, logger="rollhub.client"):
        writer.write(groups(manager, 2))
    assert "registered again" in caplog.text and writer.groups_sent == 4
    served = trainer.get_batch(wait_s=5.0)
    assert served is not None and [g.policy_version for g in served] == [2, 2]
    assert all(g.env_id == writer.env_id for g in served)
    writer.close()
    trainer.close()
