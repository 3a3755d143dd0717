"""A trainer's exact state as arrays plus JSON-able values: model weights, optimizer moments, the torch RNG.

Array names: ``model.<parameter>``, ``optim.<index>.<slot>`` and ``rng.torch``; the optimizer's hyperparameters
(``param_groups``) go with the values. PPO and GRPO checkpoints share this layout.

All arrays are numpy. A tensor in a dtype numpy has no type for (``bfloat16``, the ``float8`` types) is
stored as float32, which holds every such value exactly; loading casts each one back to the dtype of the
tensor it is loaded into (``load_state_dict`` copies into the model's own tensors, and torch's optimizers, like
:class:`rollhub.train.adam.Adam`, cast moments to their parameter's dtype). With the mixed-precision scheme
(:mod:`rollhub.train.precision`) the trainer's model and moments are float32 anyway: the checkpoint holds the
master weights, not their ``bfloat16`` image.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn


def _array(value: Any) -> np.ndarray:
    """A numpy copy of ``value`` (a tensor or array-like); float32 where numpy lacks the dtype (exact)."""
    tensor = torch.as_tensor(value).detach().cpu()
    try:
        return tensor.numpy().copy()
    except TypeError:  # bfloat16, float8: numpy has no such dtype, float32 holds their values exactly
        return tensor.float().numpy()


def training_arrays(model: nn.Module, optimizer: Any) -> tuple[dict[str, np.ndarray], list[Any]]:
    """The arrays of ``model`` and ``optimizer`` (a ``torch.optim`` optimizer or :class:`rollhub.train.adam.Adam`:
    anything with torch's ``state_dict`` layout) and the torch RNG, and the optimizer's ``param_groups``."""
    arrays = {f"model.{k}": _array(v) for k, v in model.state_dict().items()}
    optim = optimizer.state_dict()
    for index, slots in optim["state"].items():
        for key, value in slots.items():
            arrays[f"optim.{index}.{key}"] = _array(value)
    arrays["rng.torch"] = torch.get_rng_state().numpy().copy()
    return arrays, optim["param_groups"]


def load_training_arrays(model: nn.Module, optimizer: Any, arrays: Mapping[str, np.ndarray],
                         param_groups: list[Any]) -> None:  # fmt: skip
    """Restore what :func:`training_arrays` returned into ``model``, ``optimizer`` and the torch RNG (each
    tensor in the dtype of the one it replaces; see the module docstring)."""
    own = model.state_dict()
    weights = {k[6:]: torch.tensor(v) for k, v in arrays.items() if k.startswith("model.")}
    model.load_state_dict({k: v.to(own[k].dtype) if k in own else v for k, v in weights.items()})
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in arrays.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = torch.tensor(value)
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    torch.set_rng_state(torch.tensor(arrays["rng.torch"]))
