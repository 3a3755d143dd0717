"""Shared by the tests that start a real vLLM engine.

The shared engine serves vLLM's token route too (``--enable-scale-out``), which the tests of pushes under running
generations sample through.

The modules on the digits-only tiny Qwen2 (:data:`DIGITS`) share one engine (:func:`digits_engine`): an engine
start costs tens of seconds of a busy CPU. It starts on first use and stops at the end of the session; a test that
needs the model's own weights asks for :func:`digits_engine_as_built`, since other tests push theirs into it. The
test that kills it (``test_vllm_engine.py``) runs in the module that sorts last among its users; should a test
still find it dead, a new one is started.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollhub.inference.engine import EngineError, EngineSpec, VLLMEngine, find_vllm_python
from rollhub.models import TinyModelSpec, build_tiny_model

# digits, "=" and "+" only: a random model samples digits often (the mock task rewards them) and its
# end-of-sequence token often (turns end on their own), and a prompt of 200 digits is 200 tokens, longer than one
# KV-cache block
TOKEN_ROUTE = ("--enforce-eager", "--enable-scale-out")  # the engine's arguments: also vLLM's token route
DIGITS = TinyModelSpec(corpus=("0123456789+=",), all_bytes=False, vocab_size=16, max_position_embeddings=512)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter with vLLM; skips without one, except under ``make test`` (ROLLHUB_REQUIRE_VLLM=1)."""
    try:
        return find_vllm_python()
    except EngineError as exc:
        if os.environ.get("ROLLHUB_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"no vLLM here ({exc})")


@pytest.fixture(scope="session")
def digits_spec() -> TinyModelSpec:
    """:data:`DIGITS`, for tests that build a second model of the same shape."""
    return DIGITS


@pytest.fixture(scope="session")
def digits_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The :data:`DIGITS` model, built once for the session."""
    return build_tiny_model(tmp_path_factory.mktemp("digits") / "model", DIGITS)


class SharedEngine:
    """One engine on the digits model, started when first asked for and again if a test killed it."""

    def __init__(self, model_dir: Path, python: str, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.python = python
        self.log_dir = log_dir
        self.engine: VLLMEngine | None = None
        self.starts = 0

    def get(self) -> VLLMEngine:
        """The running engine."""
        if self.engine is not None and self.engine.process.poll() is not None:
            self.engine.stop()
            self.engine = None
        if self.engine is None:
            self.starts += 1
            log = self.log_dir / f"vllm-{self.starts}.log"
            spec = EngineSpec(model=str(self.model_dir), python=self.python, max_model_len=512, kv_cache_gb=1,
                              log_path=log, ready_timeout_s=600, args=TOKEN_ROUTE)  # fmt: skip
            self.engine = VLLMEngine.start(spec)
        return self.engine

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()


@pytest.fixture(scope="session")
def shared_digits_engine(digits_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                         vllm_python: str) -> Iterator[SharedEngine]:  # fmt: skip
    shared = SharedEngine(digits_model_dir, vllm_python, tmp_path_factory.mktemp("engine"))
    yield shared
    shared.stop()


@pytest.fixture
def digits_engine(shared_digits_engine: SharedEngine) -> VLLMEngine:
    """The session's engine on :func:`digits_model_dir`, holding whatever weights the last test pushed."""
    return shared_digits_engine.get()


@pytest.fixture
def digits_engine_as_built(digits_engine: VLLMEngine, digits_model_dir: Path, tmp_path: Path) -> VLLMEngine:
    """The session's engine serving :func:`digits_model_dir`'s own weights: as it started if no version was pushed
    into it yet, else with those weights pushed back (undoing earlier tests' pushes)."""
    import httpx

    from rollhub.models import load_causal_lm
    from rollhub.weights.checkpoint import CheckpointDirectory
    from rollhub.weights.engine import EngineWeightPublisher, engine_version

    with httpx.Client(base_url=digits_engine.url, timeout=60) as http:
        if engine_version(http) is None:
            return digits_engine
    weights = {k: v.detach().numpy() for k, v in load_causal_lm(str(digits_model_dir)).state_dict().items()}
    publisher = EngineWeightPublisher([digits_engine.url], CheckpointDirectory(tmp_path / "own-weights", keep_last=1))
    try:
        publisher.publish(0, weights)
    finally:
        publisher.close()
    return digits_engine
