"""TrainerClient and EnvClient over real loopback servers: rollhub (msgpack) and AtroposLib 0.4.0 (JSON)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from rollhub.client import (
    AsyncEnvClient,
    AsyncTrainerClient,
    EnvClient,
    TrainerClient,
    to_group,
)
from rollhub.client.env import encode_groups
from rollhub.errors import InvalidInput, NotRegistered, Unauthorized, UnknownBatch, UnknownEnv
from rollhub.experience import Group
from tests.client.conftest import new_server, start_trainer, toy_group
from tests.conftest import ServerProcess


def _register(env: EnvClient, group_size: int = 2) -> int:
    registration = env.register_env(desired_name="toy", group_size=group_size, max_token_length=64)
    assert registration is not None
    return registration.env_id


@pytest.mark.parametrize("kind", ["rollhub", "atropos"])
def test_a_batch_asked_of_a_server_no_trainer_ever_registered_with_is_not_registered(kind: str) -> None:
    # a fresh server, not the session's reset one: AtroposLib 0.4.0's /reset_data deletes the queue its /batch then
    # reads, so a reset server that once had a trainer answers /batch with a 500 until a trainer registers again
    server = new_server(kind)
    try:
        with pytest.raises(NotRegistered):
            TrainerClient(server.url).get_batch()
    finally:
        server.stop()


def test_round_trip_and_format_negotiation(any_server) -> None:
    url = any_server.url
    rollhub = isinstance(any_server, ServerProcess)
    trainer = TrainerClient(url)
    env = EnvClient(url)
    assert env.register_env(desired_name="toy", group_size=2, max_token_length=64) is None, "trainer not started"
    trainer.register(batch_size=4, max_token_len=64, num_steps=10, wandb_group="grp", wandb_project="proj")
    assert trainer.info().batch_size == 4
    assert trainer.get_batch() is None
    assert env.wandb_info() == {"group": "grp", "project": "proj"}
    env_id = _register(env)
    numpy_group = {
        "tokens": np.array([[5, 6, 7], [5, 8, 9]]),
        "masks": [np.array([-100, 6, 7]), np.array([-100, 8, 9])],
        "scores": np.array([1.0, -1.0]),
        "inference_logprobs": [[1.0, -0.5, -0.25], [1.0, -0.75, -0.125]],
    }
    answer = env.send([to_group(numpy_group, env_id), to_group(toy_group(6), env_id)])
    assert answer["status"] == "received" and answer["groups_processed"] == 2
    assert env.binary is rollhub, "msgpack on rollhub, JSON fallback remembered on 0.4.0"
    assert trainer.status().queue_size == 2

    batch = trainer.get_batch()
    assert batch is not None and len(batch) == 2 and batch.sequences == 4
    assert all(type(g) is Group for g in batch), "the same type over msgpack (rollhub) and JSON (0.4.0)"
    first = next(g for g in batch if int(g.tokens.row(0)[0]) == 5)
    assert [row.tolist() for row in first.tokens.rows()] == [[5, 6, 7], [5, 8, 9]]
    assert [row.tolist() for row in first.masks.rows()] == [[-100, 6, 7], [-100, 8, 9]]
    assert first.scores.dtype == np.float64 and first.scores.tolist() == [1.0, -1.0]
    assert first.inference_logprobs is not None
    assert first.inference_logprobs.row(1).astype(np.float64).tolist() == [1.0, -0.75, -0.125]
    assert first.env_id == env_id and first.meta.get("overrides") is None and first.advantages is None
    env_status = env.status_env(env_id)
    assert env_status.current_step == 1 and env_status.env_weight == 1.0
    assert env.disconnect_env(env_id)


def test_lease_ack_and_long_poll(rollhub_server: ServerProcess) -> None:
    trainer = start_trainer(rollhub_server.url, batch_size=2)
    env = EnvClient(rollhub_server.url)
    env_id = _register(env)

    arrived = threading.Event()

    def send_later() -> None:
        arrived.wait(30)
        env.send([to_group(toy_group(1), env_id)])

    sender = threading.Thread(target=send_later)
    sender.start()
    arrived.set()
    batch = trainer.get_batch(wait_s=30, lease_s=60)  # returns when the group arrives, long before 30 s
    sender.join()
    assert batch is not None and batch.batch_id and batch.step is not None
    trainer.ack(batch.batch_id)
    with pytest.raises(UnknownBatch, match="404"):
        trainer.ack(batch.batch_id)


def test_server_validation_errors_raise_with_the_servers_message(rollhub_server: ServerProcess) -> None:
    start_trainer(rollhub_server.url)
    env = EnvClient(rollhub_server.url)
    env_id = _register(env, group_size=2)
    with pytest.raises(InvalidInput, match="group_size 2"):
        env.send([to_group(toy_group(1, n=3), env_id)])  # bigger than the registered group size
    with pytest.raises(UnknownEnv, match="register the env again"):
        env.send([to_group(toy_group(1), 99)])
    with pytest.raises(UnknownEnv, match="404"):
        env.status_env(99)


def test_groups_are_checked_before_sending() -> None:
    with pytest.raises(InvalidInput, match=r"masks\[1\]"):
        to_group({"tokens": [[1, 2], [3, 4]], "masks": [[1, 2], [3]], "scores": [0, 1]})
    with pytest.raises(InvalidInput, match="scores"):
        to_group({"tokens": [[1, 2]], "masks": [[1, 2]], "scores": [0.0, 1.0]})
    with pytest.raises(InvalidInput, match="tokens"):
        to_group({"tokens": np.array([[0.5, 1.5]]), "masks": [[1, 2]], "scores": [0.0]})
    with pytest.raises(InvalidInput, match="mapping"):
        to_group([[1, 2]])


def test_large_json_bodies_are_gzipped_and_arrive_intact(atropos_server) -> None:
    trainer = start_trainer(atropos_server.url, batch_size=2)
    env = EnvClient(atropos_server.url, binary=False)
    env_id = _register(env)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=(2, 20_000))
    group = to_group({"tokens": tokens, "masks": tokens, "scores": [0.25, 0.75]}, env_id)
    body, headers = encode_groups([group], as_list=False, binary=False)
    assert headers.get("Content-Encoding") == "gzip" and len(body) < len(tokens.tobytes())
    assert env.send([group])["status"] == "received"
    batch = trainer.get_batch()
    assert batch is not None and np.array_equal(np.stack(batch[0].tokens.rows()), tokens)
    with pytest.raises(InvalidInput, match="exactly one group"):
        env.send([group, group], as_list=False)


def test_api_key_from_argument_or_environment(
    server_factory: type[ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = server_factory("--storage", "memory", "--api-key", "s3cret").start()
    monkeypatch.delenv("ROLLHUB_API_KEY", raising=False)
    with pytest.raises(Unauthorized, match="api_key"):
        TrainerClient(server.url).info()
    assert TrainerClient(server.url, api_key="s3cret").info().batch_size == -1
    monkeypatch.setenv("ROLLHUB_API_KEY", "s3cret")
    assert EnvClient(server.url).info().batch_size == -1


def test_async_clients(any_server) -> None:
    async def scenario() -> None:
        async with AsyncTrainerClient(any_server.url) as trainer:
            await trainer.register(batch_size=2, max_token_len=64, num_steps=10)
            assert await trainer.get_batch() is None
            env = AsyncEnvClient(any_server.url)
            registration = await env.register_env(desired_name="toy", group_size=2, max_token_length=64)
            assert registration is not None and registration.wandb_name == "toy_0"
            await env.send([to_group(toy_group(3), registration.env_id)])
            assert (await env.status_env(registration.env_id)).queue_size == 1
            batch = await trainer.get_batch(wait_s=1.0)
            assert batch is not None and isinstance(batch[0], Group) and int(batch[0].tokens.row(0)[0]) == 3
            assert (await trainer.status()).current_step == 1
            await env.aclose()

    asyncio.run(scenario())
