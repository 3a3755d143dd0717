"""Mixed precision for a policy served in ``bfloat16`` or ``float16``: fp32 master weights, low-precision compute,
weights published in the policy's dtype.

``policy.dtype`` names the dtype the inference engine serves. The trainer does not train in it:

1. **Master weights in float32.** The model the optimizer updates is loaded in float32 whatever
   ``policy.dtype`` says (:data:`MASTER_DTYPE`), so Adam's updates, which are often smaller than a
   ``bfloat16`` weight's resolution (8 significant bits), accumulate instead of rounding away. Gradients and
   Adam's moments are float32 too.
2. **Compute in the policy's dtype.** The loss's forward pass runs under ``torch.autocast`` on the model's
   device with ``dtype = policy.dtype`` (:func:`compute_autocast`): matrix products see the weights rounded to
   the policy's dtype, as the engine does, while log-softmax, the ratio and the loss stay float32 (the loss
   casts the logits to float32 before its log-softmax). The backward pass runs outside the context and
   writes float32 gradients. No loss scaling is done: with ``float16`` very small gradients can flush to zero,
   ``bfloat16`` has float32's range and does not.
3. **Publish in the policy's dtype.** :meth:`Precision.cast_for_publish` casts the master weights to
   ``policy.dtype`` (floating tensors only) on the CPU: what the engine loads is the master copy rounded to
   nearest, the same numbers the autocast forward multiplies with.

With ``policy.dtype = "float32"`` every piece is the identity: no autocast, nothing cast.

A trainer's checkpoint (:mod:`rollhub.train.checkpointing`) holds the float32 master weights and moments, so
a resumed run continues the exact master copy, not its rounded image.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rollhub.errors import RollhubError
from rollhub.models.hf import _DTYPES as DTYPES  # policy.dtype's names -> torch dtypes (load_causal_lm's too)

MASTER_DTYPE = torch.float32
MASTER_DTYPE_NAME = "float32"  # the name rollhub.models.load_causal_lm takes for MASTER_DTYPE


class PrecisionError(RollhubError):
    """A dtype the mixed-precision scheme does not know, or a model that does not hold float32 master weights."""


def device_type(model: nn.Module) -> str:
    """The device type (``"cpu"``, ``"cuda"``...) of ``model``'s first parameter; ``"cpu"`` without parameters."""
    for param in model.parameters():
        return param.device.type
    return "cpu"


def compute_autocast(model: nn.Module, compute_dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """The context a forward pass of ``model`` runs in: ``torch.autocast(<model's device>, dtype=compute_dtype)``,
    or a context that changes nothing when ``compute_dtype`` is ``None`` or float32.

    Wrap the forward pass only (and what reads its outputs, e.g. the loss); call ``backward`` outside it.
    """
    if compute_dtype is None or compute_dtype == MASTER_DTYPE:
        return contextlib.nullcontext()
    return torch.autocast(device_type(model), dtype=compute_dtype)


@dataclass(frozen=True, slots=True)
class Precision:
    """The precision scheme of one run (see the module docstring), fixed by the policy's dtype.

    Attributes:
        policy_dtype: what the engine serves and what :meth:`cast_for_publish` returns (``policy.dtype``).
    """

    policy_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.policy_dtype not in DTYPES.values():
            raise PrecisionError(f"policy dtype {self.policy_dtype} is not one of {sorted(DTYPES)}")

    @classmethod
    def named(cls, name: str) -> Precision:
        """The scheme of ``policy.dtype = name``.

        Raises:
            PrecisionError: ``name`` is not ``float32``, ``bfloat16`` or ``float16``.
        """
        if name not in DTYPES:
            raise PrecisionError(f"policy.dtype {name!r} is not one of {sorted(DTYPES)}; pick one of them")
        return cls(DTYPES[name])

    @classmethod
    def for_policy(cls, policy: Any) -> Precision:
        """The scheme of a ``[policy]`` section: its ``dtype`` (a Hugging Face policy), else float32 (the
        built-in models have no dtype setting and are float32)."""
        return cls.named(getattr(policy, "dtype", MASTER_DTYPE_NAME))

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the weights the optimizer updates: always float32."""
        return MASTER_DTYPE

    @property
    def mixed(self) -> bool:
        """Whether compute and publishing use a dtype other than the master weights'."""
        return self.policy_dtype != MASTER_DTYPE

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast dtype of the loss's forward pass; ``None`` for a float32 policy (no autocast). What
        :class:`rollhub.train.grpo.GRPOTrainer` takes as ``compute_dtype``."""
        return self.policy_dtype if self.mixed else None

    def autocast(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """:func:`compute_autocast` of ``model`` in :attr:`compute_dtype`."""
        return compute_autocast(model, self.compute_dtype)

    def cast_for_publish(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (e.g. the trainer's ``weights()``) as the engine should load it: detached, on the CPU,
        floating tensors in :attr:`policy_dtype` (rounded to nearest), other tensors as they are. Names and
        order are kept. A tensor that needs no cast or move is returned as it is (not copied), so pass a copy
        if the model will change it while the result is in use."""
        out = {}
        for name, tensor in state.items():
            dtype = self.policy_dtype if tensor.is_floating_point() else tensor.dtype
            out[name] = tensor.detach().to(device="cpu", dtype=dtype)
        return out

    def check_master(self, model: nn.Module) -> None:
        """Check that every floating parameter of ``model`` is float32 (the master copy the optimizer updates).

        Raises:
            PrecisionError: a parameter is in another dtype (its name and dtype are in the message).
        """
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.dtype != MASTER_DTYPE:
                raise PrecisionError(
                    f"parameter {name!r} is {param.dtype}: the trainer's model must hold float32 master weights "
                    f"whatever policy.dtype is; load it in float32 (load_causal_lm(path, '{MASTER_DTYPE_NAME}'))"
                )
