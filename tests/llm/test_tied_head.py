"""A tied output head on vLLM-CPU is refused before an engine starts unless it is served in bfloat16 and loaded in
place: vLLM-CPU's reload never refreshes the packed copy of a tied head, so the engine would sample from the initial
head after every push; and a run whose engine refuses the in-place load of a tied head stops at the first push."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from transformers import Qwen2Config

from rollhub.inference.engine import is_vllm_cpu
from rollhub.run.config import RunConfigError
from rollhub.run.llm import refuse_tied_head_on_cpu, ties_output_head


def _venv(root: Path, dist: str | None) -> str:
    """A virtual environment's layout with ``dist`` (a distribution name) installed; returns its python."""
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    python.write_text("")
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if dist is not None:
        (site / f"{dist}-0.32.0.dist-info").mkdir()
    return str(python)


def _model(path: Path, tied: bool) -> str:
    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    config.save_pretrained(path)
    return str(path)


def test_the_cpu_build_is_told_from_the_environment_it_is_installed_in(tmp_path: Path) -> None:
    assert is_vllm_cpu(_venv(tmp_path / "cpu", "vllm_cpu"))
    assert not is_vllm_cpu(_venv(tmp_path / "gpu", "vllm"))
    assert not is_vllm_cpu(_venv(tmp_path / "none", None))
    assert isinstance(is_vllm_cpu(sys.executable), bool)


def test_a_tied_head_is_refused_on_vllm_cpu_naming_the_field_and_the_fix(tmp_path: Path) -> None:
    tied, untied = _model(tmp_path / "tied", True), _model(tmp_path / "untied", False)
    assert ties_output_head(tied) and not ties_output_head(untied)
    cpu, gpu = _venv(tmp_path / "cpu", "vllm_cpu"), _venv(tmp_path / "gpu", "vllm")
    with pytest.raises(RunConfigError, match=r"policy\.model") as refused:
        refuse_tied_head_on_cpu(tied, cpu)
    assert "tie_word_embeddings = False" in str(refused.value) and "save_pretrained" in str(refused.value)
    refuse_tied_head_on_cpu(untied, cpu)  # an untied head is loaded, and repacked, by every push
    refuse_tied_head_on_cpu(tied, gpu)  # elsewhere the head is the embedding's own tensor


def test_a_tied_head_in_bfloat16_loaded_in_place_is_allowed_and_named_for_the_push(tmp_path: Path) -> None:
    tied, untied = _model(tmp_path / "tied", True), _model(tmp_path / "untied", False)
    cpu = _venv(tmp_path / "cpu", "vllm_cpu")
    assert refuse_tied_head_on_cpu(tied, cpu, "bfloat16", "in_place") is True  # every push must load in place
    assert refuse_tied_head_on_cpu(untied, cpu, "bfloat16", "in_place") is False
    for dtype, load in (("bfloat16", "reload"), ("float32", "in_place"), ("float16", "in_place")):
        with pytest.raises(RunConfigError, match=r'policy\.dtype = "bfloat16"\) with inference\.push_load'):
            refuse_tied_head_on_cpu(tied, cpu, dtype, load)


def test_a_run_whose_engine_refuses_the_in_place_load_of_a_tied_head_stops_at_the_first_push(tmp_path: Path) -> None:
    import httpx
    import numpy as np

    from rollhub.run.llm import EngineBackend
    from rollhub.weights.checkpoint import CheckpointDirectory
    from rollhub.weights.engine import EngineWeightPublisher

    def engine(request: httpx.Request) -> httpx.Response:  # an engine whose kernels pack bfloat16
        if request.url.path == "/collective_rpc" and b"rollhub_load_in_place" in request.content:
            return httpx.Response(200, json={"results": [{"refused": "24 layers compute from packed copies"}]})
        return httpx.Response(200, json={})

    backend = EngineBackend.__new__(EngineBackend)
    backend.model, backend.tied, backend._tied_on_cpu = "tied-model", frozenset({"lm_head.weight"}), True
    backend.publisher = EngineWeightPublisher(["http://engine"], CheckpointDirectory(tmp_path, 1),
                                              transport=httpx.MockTransport(engine))  # fmt: skip
    backend.supervisor = type("Supervisor", (), {"publish": staticmethod(backend.publisher.publish)})()
    weights = {"model.embed_tokens.weight": np.ones((4, 2), np.float32), "lm_head.weight": np.ones((4, 2))}
    with pytest.raises(RunConfigError, match=r"refused the in-place load \(engine 0: 24 layers .*untied copy"):
        backend.deliver(0, weights)
