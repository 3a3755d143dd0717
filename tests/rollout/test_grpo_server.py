"""ServerGRPOLoop against a real ``rollhub serve``: stale groups are counted and never trained on; batches are
acknowledged whether trained on or skipped; each published version is announced to the buffer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollhub.client.env import EnvClient, to_group
from rollhub.client.trainer import TrainerClient
from rollhub.demos.serve import ChildServer, start_server
from rollhub.inference.torch_policy import TinyTransformer, TransformerConfig
from rollhub.train.grpo import GRPOConfig, GRPOTrainer
from rollhub.train.grpo_server import PullConfig, ServerGRPOLoop

torch.set_num_threads(1)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ChildServer]:
    handle = start_server(f"sqlite:///{tmp_path / 'rollhub.db'}")  # no server-side bound: the trainer's alone
    yield handle
    handle.stop()


def item(version: int) -> dict:
    return {
        "tokens": [[1, 5, 6, 7], [1, 5, 6, 8]],
        "masks": [[-100, -100, 6, 7], [-100, -100, 6, 8]],
        "scores": [0.0, 1.0],
        "inference_logprobs": [[1.0, 1.0, -2.0, -2.0], [1.0, 1.0, -2.0, -2.0]],
        "policy_version": version,
    }


class AnnouncingClient(TrainerClient):
    """A TrainerClient that records the versions announced to the buffer (``publish_version``)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.announced: list[int] = []

    def publish_version(self, version: int) -> None:
        self.announced.append(version)


def test_stale_groups_are_left_out_counted_and_acknowledged(server: ChildServer) -> None:
    trainer_client = AnnouncingClient(server.url)
    trainer_client.register(batch_size=4, max_token_len=8, num_steps=10)
    assert trainer_client.get_batch() is None
    env = EnvClient(server.url)
    registration = env.register_env(desired_name="t", group_size=2, max_token_length=8)
    assert registration is not None
    torch.manual_seed(0)
    trainer = GRPOTrainer(
        TinyTransformer(TransformerConfig(vocab_size=20, d_model=16, n_heads=2)), GRPOConfig(max_staleness=2)
    )
    trainer.step_count = 5  # as if five updates were published: versions below 3 are stale
    published: list[int] = []
    trainer.publish = lambda step, state: published.append(step)
    loop = ServerGRPOLoop(trainer, trainer_client, PullConfig(wait_s=2.0, lease_s=0.5))
    env.send([to_group(item(v), registration.env_id) for v in (1, 4)])  # one stale, one fresh
    stats = loop.step()
    assert stats is not None and stats["stale_groups"] == 1.0 and stats["max_group_staleness"] == 1.0
    assert trainer.step_count == 6 and published == [6] and loop.counters.staleness == [1]
    assert trainer_client.announced == [6]
    env.send([to_group(item(v), registration.env_id) for v in (2, 3)])  # both stale at step 6
    assert loop.step() == {"skipped": 1.0, "stale_groups": 2.0}
    assert trainer.step_count == 6 and published == [6]  # nothing trained on, nothing published
    assert trainer_client.announced == [6]  # a skipped batch moves no clock
    assert (loop.counters.batches, loop.counters.trained, loop.counters.skipped) == (2, 1, 1)
    assert loop.counters.stale_groups == 3
    assert loop.step() is None and loop.counters.empty_polls == 1  # both batches acked: none comes back
    env.close()
    trainer_client.close()
