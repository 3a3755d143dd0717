"""The sampling distribution, defined once: rollhub's processing of logits against transformers' own warpers,
the chunked log-probs against the whole-vocabulary ones, the local policy's stored log-probs against the trainer's,
and the settings a run refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from rollhub.envs.group.mock import MockEnv
from rollhub.errors import ConfigError, InvalidInput
from rollhub.inference.base import SamplingParams
from rollhub.inference.engine import EngineSpec
from rollhub.inference.override import SamplingOverride
from rollhub.inference.torch_policy import LocalPolicy
from rollhub.models.sampling import Distribution, processed_logits
from rollhub.train.grpo import GRPOConfig, GRPOTrainer, TrainingError, groups_to_batch, sampled_logprobs


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 20, 0.8), (0.5, 5, 1.0),
                                                             (1.3, 0, 0.6)])  # fmt: skip
def test_processing_matches_transformers_warpers(temperature: float, top_k: int, top_p: float) -> None:
    transformers = pytest.importorskip("transformers")
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 3
    scores = logits.clone()
    warpers = [transformers.TemperatureLogitsWarper(temperature)]
    warpers += [transformers.TopKLogitsWarper(top_k)] if top_k else []
    warpers += [transformers.TopPLogitsWarper(top_p)] if top_p < 1 else []
    for warp in warpers:
        scores = warp(torch.zeros(6, 1, dtype=torch.long), scores)
    mine = processed_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(mine), torch.isinf(scores))
    assert torch.allclose(
        torch.log_softmax(mine, -1)[~torch.isinf(mine)], torch.log_softmax(scores, -1)[~torch.isinf(mine)]
    )


def test_min_p_and_per_row_settings() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = processed_logits(probs.log(), torch.tensor([1.0, 1.0]), min_p=torch.tensor([0.2, 0.0]))
    assert torch.isinf(out[0]).tolist() == [False, False, False, True]  # 0.05 < 0.2 * 0.5
    assert not torch.isinf(out[1]).any()
    kept = torch.softmax(out[0], -1)
    assert torch.allclose(kept[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


def _groups(policy: LocalPolicy, **settings) -> list:
    groups, _ = MockEnv(max_tokens=4).sample(
        SamplingOverride(policy, settings), 4, 6, "train", np.random.default_rng(0)
    )
    for g in groups:
        g.policy_version = 0
    return groups


@pytest.mark.parametrize("settings", [{"temperature": 0.5}, {"temperature": 0.7, "top_k": 4, "top_p": 0.8},
                                      {"temperature": 1.2, "min_p": 0.1}])  # fmt: skip
def test_the_local_policy_stores_what_the_trainer_computes(policy: LocalPolicy, settings: dict) -> None:
    """At equal weights the trainer's log-probs of the recorded distribution equal the stored behaviour log-probs
    (at temperature 0.5 the old temperature-1 trainer measured a mismatch of 0.46 here)."""
    groups = _groups(policy, **settings)
    assert all(g.meta["generation_params"]["temperature"] == settings["temperature"] for g in groups)
    stats = GRPOTrainer(policy.model, GRPOConfig()).step(groups)
    assert stats["mismatch_abs"] < 1e-5 and stats["outside_support_fraction"] == 0.0
    assert stats["capped_fraction"] == 0.0 and stats["ess_fraction"] == pytest.approx(1.0)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_logprobs_equal_the_whole_vocabulary_ones(policy: LocalPolicy, chunk: int) -> None:
    """Computed a few positions at a time and recomputed in backward, the log-probs, the entropy and the gradients
    are those of the whole ``[sequences, time, vocab]`` computation."""
    batch = groups_to_batch(_groups(policy, temperature=0.7, top_k=5))
    vocab = policy.model.cfg.vocab_size
    results = []
    for elements in (None, chunk * vocab):
        policy.model.zero_grad(set_to_none=True)
        out = sampled_logprobs(policy.model, batch, elements)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        results.append((out, [p.grad.clone() for p in policy.model.parameters()]))
    (whole, whole_grads), (chunked, chunked_grads) = results
    assert torch.allclose(whole.logprobs, chunked.logprobs, atol=1e-6)
    assert torch.allclose(whole.entropy, chunked.entropy, atol=1e-5)
    for a, b in zip(whole_grads, chunked_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


class DropoutHead(nn.Module):
    """The local transformer with dropout before its head: log-probs differ from call to call in train mode."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner, self.drop = model, nn.Dropout(0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner.head(self.drop(self.inner.hidden_states(tokens)))


def test_log_probs_for_the_loss_are_computed_without_dropout(policy: LocalPolicy) -> None:
    groups = _groups(policy)
    model = DropoutHead(policy.model)
    model.train()
    stats = GRPOTrainer(model, GRPOConfig(lr=1e-6)).step(groups)
    assert stats["mismatch_abs"] < 1e-5  # with dropout on it would read the noise as a mismatch


def test_settings_the_trainer_cannot_reproduce_are_refused(policy: LocalPolicy) -> None:
    groups = _groups(policy)
    groups[1].meta["generation_params"] = {**groups[1].meta["generation_params"], "repetition_penalty": 1.05}
    with pytest.raises(TrainingError, match=r"group 1 generation_params.repetition_penalty"):
        GRPOTrainer(policy.model, GRPOConfig()).step(groups)
    groups[1].meta["generation_params"] = {"temperature": 0.0}
    with pytest.raises(TrainingError, match="temperature > 0"):
        GRPOTrainer(policy.model, GRPOConfig()).step(groups)
    with pytest.raises(InvalidInput, match="top_p"):
        Distribution(top_p=0.0)
    with pytest.raises(Exception, match="penalt"):
        policy.complete(["1="], 2, SamplingParams(repetition_penalty=1.1), np.random.default_rng(0))


def test_the_override_leaves_greedy_requests_alone(policy: LocalPolicy) -> None:
    override = SamplingOverride(policy, {"temperature": 0.5, "top_k": 3})
    sampled = override.complete(["1="], 2, SamplingParams(max_tokens=2), np.random.default_rng(0))[0][0]
    greedy = override.complete(["1="], 1, SamplingParams(max_tokens=2, temperature=0.0), np.random.default_rng(0))
    assert (sampled.params.temperature, sampled.params.top_k) == (0.5, 3)
    assert greedy[0][0].params.temperature == 0.0 and greedy[0][0].params.top_k == 0
    assert override.load_weights == policy.load_weights  # everything else is the policy's
    with pytest.raises(ConfigError, match="bogus"):
        SamplingOverride(policy, {"bogus": 1})


def test_the_run_config_sampling_section() -> None:
    import tomllib
    from importlib.resources import files

    from rollhub.run.config import RunConfigError, load_config

    data = tomllib.loads(files("rollhub.run.configs").joinpath("arithmetic.toml").read_text())
    config = load_config(data, ["sampling.temperature=0.7", "sampling.top_p=0.9", "sampling.stop=['END']"])
    assert config.sampling.overrides() == {"temperature": 0.7, "top_p": 0.9, "stop": ("END",)}
    assert load_config(data).sampling.overrides() == {}
    for bad in ("sampling.repetition_penalty=1.05", "sampling.temperature=0", "sampling.top_p=1.5",
                "sampling.frequency_penalty=0.5"):  # fmt: skip
        with pytest.raises(RunConfigError, match=bad.split("=")[0]):
            load_config(data, [bad])


def test_engines_rollhub_starts_sample_from_the_request_and_return_processed_logprobs() -> None:
    command = EngineSpec(model="m").command("python", 8000)
    assert command[command.index("--generation-config") + 1] == "vllm"
    assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    mine = EngineSpec(model="m", args=("--logprobs-mode", "raw_logprobs")).command("python", 8000)
    assert mine.count("--logprobs-mode") == 1 and mine[mine.index("--logprobs-mode") + 1] == "raw_logprobs"
