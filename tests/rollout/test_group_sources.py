"""``train_grpo`` on a ``ServerGroupSource`` against a real ``rollhub serve``: stale groups are counted and never
trained on; batches are acknowledged whether trained on or skipped; each published version is announced to the
buffer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollhub.client.env import EnvClient, to_group
from rollhub.client.trainer import TrainerClient
from rollhub.inference.torch_policy import TinyTransformer, TransformerConfig
from rollhub.run.child_server import ChildServer, start_server
from rollhub.run.sources import ServerGroupSource
from rollhub.train.grpo import GRPOConfig, GRPOState, GRPOTrainer, train_grpo

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
    source = ServerGroupSource(trainer_client, lease_s=0.5)
    state = GRPOState()
    sent = iter([(1, 4), (2, 3), (5, 6)])  # one stale, one fresh; both stale at version 6; both fresh

    def feed() -> str | None:
        """Before each pull, send the next pair of groups (the loop pulls one batch of 4 sequences each)."""
        pair = next(sent, None)
        if pair is None:
            return "fed"
        env.send([to_group(item(v), registration.env_id) for v in pair])
        return None

    stats_seen: list[dict[str, float]] = []
    reason = train_grpo(trainer, source, state, stop_reason=feed,
                        after_update=lambda s, stats: stats_seen.append(stats), wait_s=5.0)  # fmt: skip
    assert reason == "fed"
    assert published == [5, 6, 7] and trainer_client.announced == [5, 6, 7]  # a skipped batch moves no clock
    assert [s["stale_groups"] for s in stats_seen] == [1.0, 0.0]
    assert (state.batches, state.skipped, state.stale_groups) == (3, 1, 3)
    assert state.staleness == [1, 1, 0] and state.max_staleness_seen == 1
    assert trainer_client.get_batch(wait_s=1.0) is None  # every batch was acknowledged: none comes back
    env.close()
    trainer_client.close()
