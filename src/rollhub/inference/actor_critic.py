"""`ActorCritic`: the PPO policy network for discrete actions, defined once for the trainer and the fleet.

The trainer (:class:`rollhub.train.ppo.PPOLearner`) trains this module through autograd; the rollout fleet runs
:class:`rollhub.inference.mlp_policy.MLPStepPolicy`, a numpy forward pass built from this module's
``state_dict`` (the names ``actor.0.weight`` ... ``critic.4.bias``) that computes the same logits and values.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class ActorCritic(nn.Module):
    """Separate two-layer tanh MLPs for the policy logits and the value (discrete actions)."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64) -> None:
        super().__init__()

        def mlp(out: int, gain: float) -> nn.Sequential:
            layers = [nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()]
            head = nn.Linear(hidden, out)
            for layer in [*layers[::2], head]:
                nn.init.orthogonal_(layer.weight, gain=np.sqrt(2) if layer is not head else gain)
                nn.init.zeros_(layer.bias)
            return nn.Sequential(*layers, head)

        self.actor = mlp(n_actions, gain=0.01)
        self.critic = mlp(1, gain=1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.distributions.Categorical, torch.Tensor]:
        """The action distribution and the value estimate of ``obs``."""
        return torch.distributions.Categorical(logits=self.actor(obs)), self.critic(obs).squeeze(-1)


def numpy_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's ``state_dict`` as numpy arrays (what a :class:`rollhub.weights.WeightPublisher` publishes)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
