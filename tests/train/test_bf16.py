"""``policy.dtype = "bfloat16"``: float32 master weights, the loss's forward under autocast, bfloat16 weights
published through safetensors, and trainer checkpoints that survive bfloat16 tensors."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from safetensors import safe_open
from safetensors.torch import load_file

from rollhub.experience import Group
from rollhub.models import TinyModelSpec, build_tiny_model, load_causal_lm, logits_of
from rollhub.run.config import RunConfig, load_config
from rollhub.run.rundir import RunDirectory
from rollhub.train.adam import Adam
from rollhub.train.checkpointing import load_training_arrays, training_arrays
from rollhub.train.grpo import GRPOConfig, GRPOTrainer
from rollhub.train.precision import Precision, PrecisionError
from rollhub.weights.checkpoint import CheckpointDirectory
from rollhub.weights.engine import EngineWeightPublisher
from rollhub.wire.group import group_from_json

torch.set_num_threads(1)
SPEC = TinyModelSpec(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
                     num_hidden_layers=1, seed=3)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", SPEC)


def hf_config(model: Path, dtype: str) -> RunConfig:
    return load_config({
        "env": {"kind": "group", "id": "arithmetic", "kwargs": {"max_operand": 9}},
        "policy": {"kind": "hf", "model": str(model), "dtype": dtype},
    })  # fmt: skip


def grpo_config(lr: float) -> GRPOConfig:
    """Random batches are far off-policy: no mismatch warning."""
    return GRPOConfig(lr=lr, mismatch_warn=None)


def groups(vocab: int, version: int = 0, seed: int = 0) -> list[Group]:
    """Two groups of four sequences (prompt of 3 tokens, completion of 4) with spread-out scores."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        tokens = rng.integers(3, vocab, size=(4, 7)).tolist()
        out.append(group_from_json({
            "tokens": tokens,
            "masks": [[-100] * 3 + row[3:] for row in tokens],
            "inference_logprobs": [[1.0] * 3 + [-4.0] * 4 for _ in tokens],
            "scores": [1.0, 0.0, 0.5, 0.0],
            "policy_version": version,
        }))  # fmt: skip
    return out


class FakeEngine:
    """Answers the push routes like a vLLM server in dev mode; remembers the directory it was told to reload."""

    def __init__(self) -> None:
        self.reloaded: list[Path] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/collective_rpc":
            self.reloaded.append(Path(json.loads(request.content)["kwargs"]["weights_path"]))
        return httpx.Response(200, json={})


class PushBackend:
    """The part of an EngineBackend that the run's publisher calls: ``deliver`` pushes into the engine."""

    def __init__(self, push: EngineWeightPublisher) -> None:
        self.push = push
        self.received: list[dict[str, Any]] = []

    def deliver(self, version: int, arrays: dict[str, Any]) -> None:
        self.received.append(arrays)
        self.push.publish(version, arrays)


def test_precision_names_its_pieces() -> None:
    mixed, plain = Precision.named("bfloat16"), Precision.named("float32")
    assert mixed.master_dtype == plain.master_dtype == torch.float32
    assert mixed.compute_dtype == torch.bfloat16 and mixed.mixed
    assert plain.compute_dtype is None and not plain.mixed
    state = {"w": torch.ones(2, 3), "step": torch.tensor([4], dtype=torch.int64)}
    cast = mixed.cast_for_publish(state)
    assert cast["w"].dtype == torch.bfloat16 and cast["step"].dtype == torch.int64  # only floats are cast
    assert plain.cast_for_publish(state)["w"].data_ptr() == state["w"].data_ptr()  # float32: nothing copied
    assert Precision.for_policy(object()) == plain  # a policy without a dtype setting (built-in models)
    with pytest.raises(PrecisionError, match=r"policy.dtype 'int8' is not one of"):
        Precision.named("int8")
    with pytest.raises(PrecisionError, match=r"parameter 'weight' is torch.bfloat16.*float32"):
        mixed.check_master(nn.Linear(2, 2).to(torch.bfloat16))


def test_a_bfloat16_policy_trains_a_float32_master_under_autocast(tiny_dir: Path) -> None:
    from rollhub.run.assemble import grpo_trainer
    from rollhub.run.llm import EngineBackend

    config = hf_config(tiny_dir, "bfloat16")
    backend = object.__new__(EngineBackend)  # trainer_model only reads the model directory
    backend.model = str(tiny_dir)
    model = backend.trainer_model()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    trainer = grpo_trainer(config, None, model)
    assert trainer.compute_dtype == torch.bfloat16
    with pytest.raises(PrecisionError, match="float32 master weights"):
        grpo_trainer(config, None, load_causal_lm(str(tiny_dir), "bfloat16"))
    assert grpo_trainer(hf_config(tiny_dir, "float32"), None, model).compute_dtype is None


def test_a_bfloat16_publish_round_trip(tiny_dir: Path, tmp_path: Path) -> None:
    """The run's publisher casts the float32 master to bfloat16 and the engine push writes it as safetensors: the
    file holds the model's own names in bfloat16, and a fresh float32 model loaded from it computes what the
    bfloat16-rounded master computes."""
    from rollhub.run.assemble import grpo_trainer, weights_publisher

    config = hf_config(tiny_dir, "bfloat16")
    master = load_causal_lm(str(tiny_dir), "float32")
    trainer = grpo_trainer(config, None, master)
    engine = FakeEngine()
    push = EngineWeightPublisher(["http://engine"], CheckpointDirectory(tmp_path / "engine-weights", 2),
                                 transport=httpx.MockTransport(engine))  # fmt: skip
    backend = PushBackend(push)
    trainer.publish = weights_publisher(config, RunDirectory(tmp_path / "run"), backend, None)
    trainer.publish_current()

    assert {v.dtype for v in backend.received[0].values()} == {torch.bfloat16}
    [path] = engine.reloaded
    published = load_file(path / "model.safetensors")
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as own:
        assert sorted(published) == sorted(own.keys())  # the names the engine's loader expects
    state = master.state_dict()
    for name, tensor in published.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    assert push.timings[0].nbytes == 2 * sum(t.numel() for t in published.values())
    loaded = CheckpointDirectory(tmp_path / "engine-weights").load(0)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in loaded.tensors.values())

    # a fresh float32 model from the published file, through from_pretrained (the config from the model dir)
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    shutil.copy(tiny_dir / "config.json", fresh_dir / "config.json")
    shutil.copy(path / "model.safetensors", fresh_dir / "model.safetensors")
    fresh = load_causal_lm(str(fresh_dir), "float32")
    assert {p.dtype for p in fresh.parameters()} == {torch.float32}
    rounded = copy.deepcopy(master)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    bf16_model = copy.deepcopy(master).to(torch.bfloat16)
    ids = torch.randint(3, master.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = logits_of(fresh(ids))
        torch.testing.assert_close(got, logits_of(rounded(ids)), rtol=0, atol=1e-6)  # the same numbers
        served = logits_of(bf16_model(ids)).float()
        with Precision.named("bfloat16").autocast(master):
            trained = logits_of(master(ids)).float()
        assert not torch.equal(got, logits_of(master(ids)))  # the file holds rounded weights, not the master
    scale = float(got.abs().max())
    torch.testing.assert_close(served, got, rtol=0, atol=0.02 * scale)  # bfloat16 compute on the same weights
    torch.testing.assert_close(trained, served, rtol=0, atol=0.02 * scale)  # the trainer's autocast forward


def test_a_float32_policy_delivers_numpy_arrays(tiny_dir: Path, tmp_path: Path) -> None:
    from rollhub.run.assemble import weights_publisher

    master = load_causal_lm(str(tiny_dir), "float32")
    delivered: list[dict[str, Any]] = []
    push = EngineWeightPublisher(["http://engine"], CheckpointDirectory(tmp_path / "w", 2),
                                 transport=httpx.MockTransport(FakeEngine()))  # fmt: skip
    publish = weights_publisher(hf_config(tiny_dir, "float32"), RunDirectory(tmp_path / "run"), PushBackend(push),
                        lambda version, arrays: delivered.append(arrays))  # fmt: skip
    publish(0, {k: v.clone() for k, v in master.state_dict().items()})
    assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in delivered[0].values())
    assert CheckpointDirectory(tmp_path / "w").load(0).tensors["lm_head.weight"].dtype == np.float32


def test_one_mixed_step_keeps_updates_bfloat16_would_round_away(tiny_dir: Path) -> None:
    """Adam's first step moves every weight by about ``lr``; at ``lr = 1e-5`` that is below half a bfloat16 step
    for most weights, so only the float32 master copy records it."""
    master = load_causal_lm(str(tiny_dir), "float32")
    trainer = GRPOTrainer(master, grpo_config(lr=1e-5), compute_dtype=torch.bfloat16)
    seen: list[torch.dtype] = []
    hook = master.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    before = {k: v.clone() for k, v in master.state_dict().items()}
    trainer.step(groups(master.config.vocab_size))
    hook.remove()
    assert seen == [torch.bfloat16]  # the loss's forward ran under autocast
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in master.parameters() if p.grad is not None} == {torch.float32}
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    changed = lost = 0
    for name, after in master.state_dict().items():
        delta = after - before[name]
        b16 = before[name].to(torch.bfloat16)
        moved = delta != 0
        # where a bfloat16 weight plus the same update rounds back to itself, a bf16-only model would not move
        rounded_away = moved & ((b16 + delta.to(torch.bfloat16)) == b16)
        changed += int(moved.sum())
        lost += int(rounded_away.sum())
    total = sum(v.numel() for v in before.values())
    assert changed > total // 2  # the step did update the master
    assert lost > changed // 2  # and most of those updates are below bfloat16's resolution


def test_a_mixed_trainer_checkpoint_round_trip(tiny_dir: Path, tmp_path: Path) -> None:
    master = load_causal_lm(str(tiny_dir), "float32")
    trainer = GRPOTrainer(master, grpo_config(lr=1e-3), compute_dtype=torch.bfloat16)
    trainer.step(groups(master.config.vocab_size))
    arrays, values = trainer.state_dict()
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    assert arrays["model.lm_head.weight"].dtype == np.float32  # the master, not its bfloat16 image
    directory = CheckpointDirectory(tmp_path)
    directory.save(1, arrays, {"trainer": values})
    ckpt = directory.load_latest()

    again = GRPOTrainer(load_causal_lm(str(tiny_dir), "float32"), grpo_config(lr=1e-3), compute_dtype=torch.bfloat16)
    again.load_state_dict(ckpt.tensors, ckpt.metadata["trainer"])
    assert again.step_count == 1
    for (name, a), b in zip(master.state_dict().items(), again.model.state_dict().values(), strict=True):
        assert b.dtype == torch.float32 and torch.equal(a, b), name
    theirs = again.optimizer.state_dict()["state"]
    for i, slots in trainer.optimizer.state_dict()["state"].items():
        assert slots["exp_avg_sq"].dtype == torch.float32 and torch.equal(slots["exp_avg_sq"], theirs[i]["exp_avg_sq"])
    # both continue identically
    torch.manual_seed(5)
    trainer.step(groups(master.config.vocab_size, version=1, seed=1))
    torch.manual_seed(5)
    again.step(groups(master.config.vocab_size, version=1, seed=1))
    assert all(torch.equal(a, b) for a, b in zip(master.parameters(), again.model.parameters(), strict=True))


@pytest.mark.parametrize("optimizer_type", [torch.optim.Adam, Adam])
def test_bfloat16_training_arrays_are_stored_as_float32_and_cast_back(optimizer_type: type, tmp_path: Path) -> None:
    """A model and moments that are bfloat16 themselves (not the mixed scheme) still checkpoint and load exactly."""

    def model_and_optimizer(seed: int) -> tuple[nn.Module, Any]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(torch.bfloat16)
        return model, optimizer_type(model.parameters(), lr=1e-2)

    model, optimizer = model_and_optimizer(0)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(16, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        optimizer.step()
    arrays, param_groups = training_arrays(model, optimizer)
    assert arrays["model.0.weight"].dtype == np.float32 and arrays["optim.0.exp_avg"].dtype == np.float32
    CheckpointDirectory(tmp_path).save(2, arrays, {"param_groups": param_groups})
    ckpt = CheckpointDirectory(tmp_path).load(2)

    other, other_optimizer = model_and_optimizer(1)
    load_training_arrays(other, other_optimizer, ckpt.tensors, ckpt.metadata["param_groups"])
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert b.dtype == torch.bfloat16 and torch.equal(a, b)
    ours, theirs = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    for i in ours:
        for key in ("exp_avg", "exp_avg_sq"):
            assert theirs[i][key].dtype == torch.bfloat16 and torch.equal(ours[i][key], theirs[i][key])
