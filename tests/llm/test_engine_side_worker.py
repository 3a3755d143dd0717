"""rollhub's vLLM worker extension, run here on small torch modules shaped as vLLM's CPU layers: the in-place load
copies into the parameters; a layer packed at load time that kept its parameter is copied into and packed again,
and one that did not is refused, loading nothing; and on a stand-in for vLLM's queue reader, whose busy-wait it
caps."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from tests.script_modules import load_script

from rollhub.inference.engine import (
    DEFAULT_RECHECK_MS,
    DEFAULT_SPIN_S,
    ENGINE_SIDE,
    RECHECK_ENV,
    REPACK_ENV,
    SPIN_ENV,
    WORKER_EXTENSION,
    EngineSpec,
)

spin = load_script(ENGINE_SIDE / "rollhub_vllm_spin.py")  # the extension imports it, as in the engine
ext = load_script(ENGINE_SIDE / f"{WORKER_EXTENSION.split('.')[0]}.py")


class Linear(torch.nn.Module):
    """A vLLM-CPU linear layer: ``cpu_linear(x, weight, bias)`` computes from ``weight``, or with ``packed``
    from a copy taken at load time (as oneDNN's packed weights)."""

    def __init__(self, packed: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 4), requires_grad=False)
        copy = self.weight.detach().clone()
        self.cpu_linear = (
            (lambda x, weight, bias: torch.nn.functional.linear(x, copy, bias))
            if packed
            else (lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias))
        )


class Model(torch.nn.Module):
    """Two linear layers and a norm; ``load_weights`` copies by name, as vLLM's loaders do."""

    def __init__(self, packed: bool = False) -> None:
        super().__init__()
        self.up = Linear()
        self.down = Linear(packed)
        self.norm = torch.nn.Parameter(torch.ones(4))

    def load_weights(self, weights: Any) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


class Worker(ext.InPlaceWeights):  # type: ignore[misc,name-defined]
    """A vLLM worker with the extension mixed in, around ``model``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)


def _checkpoint(tmp_path: Path, model: torch.nn.Module, skip: str = "") -> Path:
    tensors = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters() if n != skip}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_checkpoint_is_copied_into_the_parameters_the_layers_compute_with(tmp_path: Path) -> None:
    model = Model()
    weights = {n: p for n, p in model.named_parameters()}
    answer = Worker(model).rollhub_load_in_place(str(_checkpoint(tmp_path, model)))
    assert answer["tensors"] == 3 and "refused" not in answer
    for name, p in model.named_parameters():
        assert p is weights[name] and bool((p == 0.5).all())  # the same tensors, new values
    out = model.down.cpu_linear(torch.ones(1, 4), model.down.weight, None)
    assert torch.allclose(out, torch.full((1, 3), 2.0))


def test_a_layer_computing_from_a_packed_copy_is_refused_and_nothing_is_loaded(tmp_path: Path) -> None:
    model = Model(packed=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    answer = Worker(model).rollhub_load_in_place(str(_checkpoint(tmp_path, model)))
    assert "1 layers compute from packed copies" in answer["refused"] and "down" in answer["refused"]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert ext.packed_layers(model) == ["down"] and ext.packed_layers(Model()) == []


def test_an_emptied_weight_counts_as_packed() -> None:
    model = Model()
    model.up.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # vLLM's remove_weight
    assert ext.packed_layers(model) == ["up"]


def _packing_utils() -> SimpleNamespace:
    """vLLM-CPU's ``layers.utils`` in miniature: ``dispatch_cpu_unquantized_gemm`` packs a copy of the layer's
    weight into its ``cpu_linear`` and, with ``remove_weight``, empties the weight."""

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        copy = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, copy, bias)
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    return SimpleNamespace(dispatch_cpu_unquantized_gemm=dispatch_cpu_unquantized_gemm)


class LoaderModel(Model):
    """:class:`Model` whose parameters carry their own loaders, as vLLM's do (a parameter made anew has none)."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded_by: list[str] = []
        for name, param in self.named_parameters():
            param.weight_loader = lambda p, t, name=name: (self.loaded_by.append(name), p.data.copy_(t))

    def load_weights(self, weights: Any) -> set[str]:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].weight_loader(params[name], tensor)
        return set(params)


def _compute(layer: torch.nn.Module) -> torch.Tensor:
    return layer.cpu_linear(torch.ones(1, 4), layer.weight, None)


def test_layers_packed_at_load_keep_their_parameters_and_are_packed_again_by_the_in_place_load(
    tmp_path: Path,
) -> None:
    utils = _packing_utils()
    assert ext.keep_pack_sources(utils) is True
    model = LoaderModel()
    utils.dispatch_cpu_unquantized_gemm(model.down, True)  # a linear layer: packed, its weight emptied
    utils.dispatch_cpu_unquantized_gemm(model.up, False)  # an output head: packed, its weight kept
    assert model.down.weight.numel() == 0 and ext.packed_layers(model) == ["up", "down"]
    worker = Worker(model)
    for value in (0.5, 0.25):  # two versions, one after the other
        tensors = {"up.weight": torch.full((3, 4), value), "down.weight": torch.full((3, 4), value),
                   "norm": torch.full((4,), value)}  # fmt: skip
        save_file(tensors, str(tmp_path / "model.safetensors"))
        answer = worker.rollhub_load_in_place(str(tmp_path))
        assert answer["tensors"] == 3 and answer["repacked"] == 2 and "refused" not in answer
        assert torch.allclose(_compute(model.down), torch.full((1, 3), 4 * value))  # the packed copy is new
        assert torch.allclose(_compute(model.up), torch.full((1, 3), 4 * value))
        assert model.down.weight.numel() == 0 and bool((model.up.weight == value).all())  # as vLLM left them
    assert sorted(model.loaded_by) == ["down.weight", "down.weight", "norm", "norm", "up.weight", "up.weight"]


def test_without_the_pack_sources_a_packed_layer_is_still_refused(tmp_path: Path) -> None:
    model = Model()
    _packing_utils().dispatch_cpu_unquantized_gemm(model.down, True)  # packed before any source was kept
    answer = Worker(model).rollhub_load_in_place(str(_checkpoint(tmp_path, Model())))
    assert "1 layers compute from packed copies" in answer["refused"]
    assert ext.keep_pack_sources(SimpleNamespace()) is False  # a vLLM without the function is left alone


def test_every_engine_rollhub_starts_keeps_pack_sources_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert REPACK_ENV == ext.REPACK_ENV
    assert EngineSpec(model=str(tmp_path)).environment()[REPACK_ENV] == "1"
    assert REPACK_ENV not in EngineSpec(model=str(tmp_path), repack=False).environment()
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm... raises ImportError
    assert ext.keep_pack_sources() is False


def test_a_checkpoint_missing_a_parameter_is_refused_naming_it(tmp_path: Path) -> None:
    model = Model()
    with pytest.raises(ValueError, match=r"1 parameters are not in .*\(first: norm\)"):
        Worker(model).rollhub_load_in_place(str(_checkpoint(tmp_path, model, skip="norm")))


def test_a_directory_without_safetensors_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file"):
        Worker(Model()).rollhub_load_in_place(str(tmp_path))


def test_every_engine_rollhub_starts_gets_the_extension_unless_its_args_name_one() -> None:
    command = EngineSpec(model="m").command("python", 8000)
    assert command[command.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    own = EngineSpec(model="m", args=("--worker-extension-cls", "mine.Ext")).command("python", 8000)
    assert own.count("--worker-extension-cls") == 1 and own[own.index("--worker-extension-cls") + 1] == "mine.Ext"


class SpinCondition:
    """vLLM's queue reader as it waits: it spins while the last read is under ``busy_loop_s`` old, else it sleeps
    on its socket until the next write."""

    def __init__(self) -> None:
        self.busy_loop_s = 1.0
        self.last_read = time.monotonic()
        self.spins = self.sleeps = 0
        self.timeouts: list[int | None] = []

    def wait(self, timeout_ms: int | None = None) -> None:
        self.timeouts.append(timeout_ms)
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            self.spins += 1
        else:
            self.sleeps += 1


@pytest.fixture
def fake_queue(monkeypatch: pytest.MonkeyPatch) -> type[SpinCondition]:
    """A ``vllm.distributed.device_communicators.shm_broadcast`` holding a fresh copy of :class:`SpinCondition`."""
    reader = type("SpinCondition", (SpinCondition,), {"wait": SpinCondition.wait})
    names = ["vllm", "vllm.distributed", "vllm.distributed.device_communicators"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    queue = ModuleType(f"{names[-1]}.shm_broadcast")
    queue.SpinCondition = reader  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, queue.__name__, queue)
    monkeypatch.setattr(sys.modules[names[-1]], "shm_broadcast", queue, raising=False)
    return reader


def test_a_capped_reader_sleeps_once_its_cap_has_passed_since_the_last_read(fake_queue: type[SpinCondition]) -> None:
    plain, capped = fake_queue(), fake_queue()
    plain.last_read = capped.last_read = time.monotonic() - 0.5  # half a second after the last message
    fake_queue.wait(plain)
    assert (plain.spins, plain.sleeps) == (1, 0)  # vLLM's own second: still spinning
    assert spin.spin_cap() is None and spin.shorten_spin(0.005)
    capped.wait()
    plain.wait()
    assert (capped.spins, capped.sleeps) == (0, 1) and capped.busy_loop_s == 0.005
    assert plain.busy_loop_s == 0.005 and plain.sleeps == 1  # readers made before the cap get it too
    fresh = fake_queue()
    fresh.wait()
    assert fresh.spins == 1  # within the cap of its last read it still spins
    assert spin.shorten_spin(0.25) and spin.spin_cap() == 0.25  # a second call replaces the cap, never stacks it
    assert fake_queue.wait._rollhub_original is SpinCondition.wait  # type: ignore[attr-defined]


def test_a_capped_reader_never_sleeps_longer_than_the_recheck(fake_queue: type[SpinCondition]) -> None:
    """A lost wake-up must cost at most ``RECHECK_MS``, not vLLM's 5 s recheck: every sleep the reader is asked
    for, indefinite ones included, reaches vLLM's wait capped; shorter ones pass unchanged."""
    plain = fake_queue()
    fake_queue.wait(plain, timeout_ms=5000)
    assert plain.timeouts == [5000]
    assert spin.shorten_spin(0.005)
    reader = fake_queue()
    reader.last_read = time.monotonic() - 1.0
    reader.wait(timeout_ms=5000)
    reader.wait(5000)
    reader.wait()
    reader.wait(timeout_ms=7)
    reader.wait(timeout_ms=0)
    assert spin.RECHECK_MS < 5000 and spin.recheck_cap() == spin.RECHECK_MS
    assert reader.timeouts == [spin.RECHECK_MS, spin.RECHECK_MS, spin.RECHECK_MS, 7, 0] and reader.sleeps == 5
    assert spin.shorten_spin(0.005, recheck_ms=5000) and spin.recheck_cap() == 5000  # vLLM's own, given back
    reader.wait(timeout_ms=5000)
    assert reader.timeouts[-1] == 5000


def test_the_cap_comes_from_the_environment_and_a_bad_value_is_named(
    fake_queue: type[SpinCondition], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(spin.SPIN_ENV, raising=False)
    spin._spin_from_env()
    assert spin.spin_cap() is None  # unset: vLLM's own
    monkeypatch.setenv(spin.RECHECK_ENV, "20")
    spin._spin_from_env()
    assert spin.spin_cap() is None and spin.recheck_cap() is None  # the recheck is capped only with the spin
    monkeypatch.delenv(spin.RECHECK_ENV)
    monkeypatch.setenv(spin.SPIN_ENV, "0.01")
    spin._spin_from_env()
    assert spin.spin_cap() == 0.01 and spin.recheck_cap() == spin.RECHECK_MS
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(spin.SPIN_ENV, bad)
        with pytest.raises(ValueError, match=f"{spin.SPIN_ENV}=.*give the seconds"):
            spin._spin_from_env()
    monkeypatch.setenv(spin.SPIN_ENV, "0.02")
    for bad in ("0", "-5", "2.5", "soon"):
        monkeypatch.setenv(spin.RECHECK_ENV, bad)
        with pytest.raises(ValueError, match=f"{spin.RECHECK_ENV}=.*whole milliseconds"):
            spin._spin_from_env()
    assert spin.spin_cap() == 0.01  # a bad value changes nothing
    monkeypatch.setenv(spin.RECHECK_ENV, "20")
    spin._spin_from_env()
    assert (spin.spin_cap(), spin.recheck_cap()) == (0.02, 20)


def test_without_vllms_queue_nothing_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm... raises ImportError
    assert spin.shorten_spin(0.005) is False and spin.spin_cap() is None


def test_every_engine_rollhub_starts_gets_the_spin_cap_unless_told_otherwise(tmp_path: Path) -> None:
    assert (SPIN_ENV, RECHECK_ENV, DEFAULT_RECHECK_MS) == (spin.SPIN_ENV, spin.RECHECK_ENV, spin.RECHECK_MS)
    assert EngineSpec(model=str(tmp_path)).environment()[SPIN_ENV] == repr(DEFAULT_SPIN_S)
    assert EngineSpec(model=str(tmp_path), spin_s=0.2).environment()[SPIN_ENV] == "0.2"
    assert SPIN_ENV not in EngineSpec(model=str(tmp_path), spin_s=None).environment()
    assert EngineSpec(model=str(tmp_path), env={SPIN_ENV: "0.5"}).environment()[SPIN_ENV] == "0.5"
