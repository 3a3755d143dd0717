"""Shared by the tests that start a real vLLM engine."""

from __future__ import annotations

import os

import pytest

from rollhub.inference.engine import EngineError, find_vllm_python


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter with vLLM; skips without one, except under ``make test`` (ROLLHUB_REQUIRE_VLLM=1)."""
    try:
        return find_vllm_python()
    except EngineError as exc:
        if os.environ.get("ROLLHUB_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"no vLLM here ({exc})")
