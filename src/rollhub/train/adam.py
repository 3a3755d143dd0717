"""`Adam`: the Adam optimizer (Kingma and Ba, 2015) over a list of tensors, without ``torch.optim``.

Constructing any ``torch.optim`` optimizer imports ``torch._dynamo`` on first use, about 1.4 s of CPU on a small
machine, before the first update: as long as a whole CartPole run's learning. This one does the same arithmetic
with torch's multi-tensor (``_foreach``) kernels and imports nothing. Its ``state_dict`` has the layout of
``torch.optim.Adam``'s (``state[i]`` with ``step``, ``exp_avg``, ``exp_avg_sq``; one param group), so checkpoints
written with either load into either.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from rollhub.errors import ConfigError

# What torch.optim.Adam keeps in a param group besides lr, betas and eps, at the settings this Adam implements:
# written into state_dict so that torch's Adam can load it.
_TORCH_ADAM_GROUP: dict[str, Any] = {
    "weight_decay": 0.0, "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
    "differentiable": False, "fused": None, "decoupled_weight_decay": False,
}  # fmt: skip


class Adam:
    """Adam without weight decay or AMSGrad, for one group of parameters.

    Args:
        params: the tensors to train.
        lr: the learning rate (change it through ``param_groups[0]["lr"]``, as with ``torch.optim``).
        betas: the decay rates of the first and second moment estimates.
        eps: added to the root of the second moment.
    """

    def __init__(
        self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:  # fmt: skip
        self.params = list(params)
        if not self.params:
            raise ConfigError("Adam got no parameters to train")
        if not (lr >= 0 and eps >= 0 and all(0.0 <= b < 1.0 for b in betas)):
            raise ConfigError(f"Adam needs lr >= 0, eps >= 0 and betas in [0, 1); got {lr}, {eps}, {betas}")
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "betas": tuple(betas), "eps": eps}]
        self.steps = 0
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self) -> None:
        """Forget every parameter's gradient."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step on every parameter that has a gradient."""
        group = self.param_groups[0]
        lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], float(group["eps"])
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return
        params = [self.params[i] for i in live]
        grads = [self.params[i].grad for i in live]
        exp_avg = [self.exp_avg[i] for i in live]
        exp_avg_sq = [self.exp_avg_sq[i] for i in live]
        self.steps += 1
        torch._foreach_lerp_(exp_avg, grads, 1.0 - beta1)  # m <- beta1 m + (1 - beta1) g
        torch._foreach_mul_(exp_avg_sq, beta2)  # v <- beta2 v + (1 - beta2) g^2
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1.0 - beta2)
        step_size = lr / (1.0 - beta1**self.steps)
        denom = torch._foreach_sqrt(exp_avg_sq)  # sqrt(v_hat) + eps, with v_hat = v / (1 - beta2^t)
        torch._foreach_div_(denom, math.sqrt(1.0 - beta2**self.steps))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avg, denom, -step_size)

    def state_dict(self) -> dict[str, Any]:
        """The moments and step count per parameter index, and the hyperparameters (``torch.optim.Adam``'s
        layout)."""
        state = {}
        if self.steps:
            for i in range(len(self.params)):
                step = torch.tensor(float(self.steps))
                state[i] = {"step": step, "exp_avg": self.exp_avg[i].clone(), "exp_avg_sq": self.exp_avg_sq[i].clone()}
        group = _TORCH_ADAM_GROUP | dict(self.param_groups[0]) | {"params": list(range(len(self.params)))}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` (or ``torch.optim.Adam.state_dict``) returned.

        Raises:
            ConfigError: it holds more than one param group, moments for a different set of parameters, or
                settings this Adam does not implement (weight decay, AMSGrad, maximize).
        """
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0].get("params", self.params)) != len(self.params):
            raise ConfigError(
                f"the optimizer state is for {sum(len(g.get('params', [])) for g in groups)} parameters in "
                f"{len(groups)} group(s); this model has {len(self.params)} in one: load a matching checkpoint"
            )
        group = groups[0]
        unsupported = {k: group[k] for k in ("weight_decay", "amsgrad", "maximize") if group.get(k)}
        if unsupported:
            raise ConfigError(f"the optimizer state uses {unsupported}, which this Adam does not implement")
        self.param_groups = [{"lr": group["lr"], "betas": tuple(group["betas"]), "eps": group["eps"]}]
        state = {int(k): v for k, v in state_dict["state"].items()}
        if state and sorted(state) != list(range(len(self.params))):
            raise ConfigError(f"the optimizer state has moments for parameters {sorted(state)}; load a matching one")
        self.steps = int(float(state[0]["step"])) if state else 0
        for i, p in enumerate(self.params):
            slots = state.get(i)  # moments take the parameter's dtype and device, as torch.optim.Adam loads them
            self.exp_avg[i] = torch.zeros_like(p) if slots is None else torch.as_tensor(slots["exp_avg"]).to(p).clone()
            self.exp_avg_sq[i] = (
                torch.zeros_like(p) if slots is None else torch.as_tensor(slots["exp_avg_sq"]).to(p).clone()
            )
