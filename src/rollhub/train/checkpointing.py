"""A trainer's exact state as arrays plus JSON-able values: model weights, optimizer moments, the torch RNG.

Array names: ``model.<parameter>``, ``optim.<index>.<slot>`` and ``rng.torch``; the optimizer's hyperparameters
(``param_groups``) go with the values. PPO and GRPO checkpoints share this layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn


def training_arrays(model: nn.Module, optimizer: Any) -> tuple[dict[str, np.ndarray], list[Any]]:
    """The arrays of ``model`` and ``optimizer`` (a ``torch.optim`` optimizer or :class:`rollhub.train.adam.Adam`:
    anything with torch's ``state_dict`` layout) and the torch RNG, and the optimizer's ``param_groups``."""
    arrays = {f"model.{k}": v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    optim = optimizer.state_dict()
    for index, slots in optim["state"].items():
        for key, value in slots.items():
            arrays[f"optim.{index}.{key}"] = torch.as_tensor(value).detach().cpu().numpy().copy()
    arrays["rng.torch"] = torch.get_rng_state().numpy().copy()
    return arrays, optim["param_groups"]


def load_training_arrays(model: nn.Module, optimizer: Any, arrays: Mapping[str, np.ndarray],
                         param_groups: list[Any]) -> None:  # fmt: skip
    """Restore what :func:`training_arrays` returned into ``model``, ``optimizer`` and the torch RNG."""
    model.load_state_dict({k[6:]: torch.tensor(v) for k, v in arrays.items() if k.startswith("model.")})
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in arrays.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = torch.tensor(value)
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    torch.set_rng_state(torch.tensor(arrays["rng.torch"]))
