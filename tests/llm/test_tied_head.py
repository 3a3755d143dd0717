"""A tied output head on vLLM-CPU is refused before an engine starts: vLLM-CPU never refreshes the packed copy of a
tied head on an in-place push, so the engine would sample from the initial head after every push."""

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
