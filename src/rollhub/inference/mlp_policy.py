"""`MLPStepPolicy`: the rollout side of the PPO actor-critic, a forward pass in numpy.

A rollout worker acts on a few observations at a time (one environment process's share, or one environment),
so the fixed cost of a forward pass is most of its time. This policy keeps the trainer's weights as numpy
arrays laid out for the pass: the first layers of the actor and the critic read the same observations and run
as one matrix product, and their heads as one product over both hidden states (a block matrix). Actions are
drawn by inverse CDF from the policy's own generator. It computes what
:class:`rollhub.inference.actor_critic.ActorCritic` (the network the trainer trains) computes, from the same
``state_dict`` names, about twice as fast as torch's functional ops on 1 to 256 observations.

Building one limits the process's BLAS to one thread, as rollout processes should run (the torch policy it
replaces set torch's threads to 1 the same way): a rollout's products are too small to gain from more, and idle
BLAS threads spin, so with 128 observations per call two worker processes ran four busy threads on two cores and
made a quarter of their steps.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from threadpoolctl import threadpool_limits

from rollhub.errors import ConfigError
from rollhub.inference.base import PolicyStep

BLOCK_ROWS = 16
"""Up to this many observations the second layers run as one block-matrix product, beyond it as two."""

UNIFORM_BLOCK = 4096
"""Uniforms drawn from the generator at once for action sampling (one draw per call costs more than a slice)."""

LAYERS = (0, 2, 4)
"""The linear layers of each ``nn.Sequential`` head of the actor-critic (tanh layers in between)."""


def _expected_shapes(obs_dim: int, n_actions: int, hidden: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for head, out in (("actor", n_actions), ("critic", 1)):
        for layer, (rows, cols) in zip(LAYERS, ((hidden, obs_dim), (hidden, hidden), (out, hidden)), strict=True):
            shapes[f"{head}.{layer}.weight"] = (rows, cols)
            shapes[f"{head}.{layer}.bias"] = (rows,)
    return shapes


class MLPStepPolicy:
    """Implements ``rollhub.rollout.protocols.StepPolicy`` for the actor-critic MLP (discrete actions).

    Args:
        obs_dim, n_actions, hidden: the network's shape (two tanh layers of ``hidden`` units per head).
        seed: seeds the action sampling (``None``: fresh entropy).
        weights: initial weights (``state_dict`` names of ``ActorCritic``); ``None``: a freshly initialised
            actor-critic's, as the trainer starts from.
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64, seed: int | None = None,
                 weights: Mapping[str, np.ndarray] | None = None) -> None:  # fmt: skip
        threadpool_limits(1, user_api="blas")  # see the module docstring
        self.shapes = _expected_shapes(obs_dim, n_actions, hidden)
        self.n_actions = n_actions
        self.hidden = hidden
        self.rng = np.random.default_rng(seed)
        self._block = np.empty(0, np.float32)  # uniforms drawn ahead (see _uniforms)
        self._drawn = 0
        self._arange: dict[int, np.ndarray] = {}
        if weights is None:
            from rollhub.inference.actor_critic import ActorCritic, numpy_weights  # torch: only when needed

            weights = numpy_weights(ActorCritic(obs_dim, n_actions, hidden))
        self.load_weights(weights)

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Take new weights (used from the next call on).

        Raises:
            ConfigError: a name is missing or unknown, or an array has the wrong shape (nothing is changed).
        """
        missing = sorted(set(self.shapes) - set(weights))
        unknown = sorted(set(weights) - set(self.shapes))
        if missing or unknown:
            raise ConfigError(f"policy weights: missing {missing}, unknown {unknown}; expected the actor-critic's "
                              "state_dict names (actor.0.weight ... critic.4.bias)")  # fmt: skip
        w = {k: np.asarray(v, np.float32) for k, v in weights.items()}
        for name, shape in self.shapes.items():
            if w[name].shape != shape:
                raise ConfigError(f"policy weights: {name} has shape {w[name].shape}, expected {shape} for this "
                                  "policy's obs_dim, n_actions and hidden")  # fmt: skip
        h, na = self.hidden, self.n_actions
        self._w1 = np.ascontiguousarray(np.concatenate([w["actor.0.weight"], w["critic.0.weight"]]).T)
        self._b1 = np.concatenate([w["actor.0.bias"], w["critic.0.bias"]])
        self._w2 = np.zeros((2 * h, 2 * h), np.float32)
        self._w2[:h, :h], self._w2[h:, h:] = w["actor.2.weight"].T, w["critic.2.weight"].T
        self._b2 = np.concatenate([w["actor.2.bias"], w["critic.2.bias"]])
        self._w3 = np.zeros((2 * h, na + 1), np.float32)
        self._w3[:h, :na], self._w3[h:, na] = w["actor.4.weight"].T, w["critic.4.weight"][0]
        self._b3 = np.concatenate([w["actor.4.bias"], w["critic.4.bias"]])

    def _heads(self, obs: np.ndarray) -> np.ndarray:
        """``[n, n_actions + 1]``: the actor's logits, then the critic's value."""
        x = np.asarray(obs, np.float32)
        y = x @ self._w1
        y += self._b1
        np.tanh(y, out=y)
        if len(y) <= BLOCK_ROWS:  # one product with the block matrix: fewer calls, more (zero) multiplies
            second = y @ self._w2
        else:
            h = self.hidden
            second = np.empty_like(y)
            np.matmul(y[:, :h], self._w2[:h, :h], out=second[:, :h])
            np.matmul(y[:, h:], self._w2[h:, h:], out=second[:, h:])
        second += self._b2
        np.tanh(second, out=second)
        out = second @ self._w3
        out += self._b3
        return out

    def act(self, obs: np.ndarray, state: np.ndarray | None) -> PolicyStep:
        """Sample one action per observation."""
        out = self._heads(obs)
        n, na = len(out), self.n_actions
        logits = out[:, :na]
        z = logits - np.maximum.reduce(logits, axis=1, keepdims=True)  # the ufuncs: no Python wrapper
        cdf = np.add.accumulate(np.exp(z), axis=1)  # unnormalised: its last column is the total
        total = cdf[:, na - 1 :]
        u = self._uniforms(n)
        u *= total
        action = np.add.reduce(cdf < u, axis=1)
        np.minimum(action, na - 1, out=action)  # u * total may round up to the total
        logp = z[self._rows(n), action]
        logp -= np.log(total[:, 0])
        return PolicyStep(action, logp, out[:, na].copy(), None)

    def _uniforms(self, n: int) -> np.ndarray:
        """``[n, 1]`` fresh uniforms in [0, 1), drawn from the generator a block at a time."""
        start = self._drawn
        if start + n > len(self._block):
            self._block = self.rng.random(max(UNIFORM_BLOCK, n), np.float32)
            start = 0
        self._drawn = start + n
        return self._block[start : start + n, None]  # each is used once: the caller may scale them in place

    def _rows(self, n: int) -> np.ndarray:
        rows = self._arange.get(n)
        if rows is None:
            rows = self._arange[n] = np.arange(n)
        return rows

    def value(self, obs: np.ndarray) -> np.ndarray:
        """Value estimates of a batch of observations."""
        return self._heads(obs)[:, self.n_actions].copy()

    def initial_state(self) -> None:
        """Feed-forward: no recurrent state."""
        return None


def make_cartpole_policy(hidden: int = 64, seed: int | None = None) -> MLPStepPolicy:
    """The inference policy for CartPole-v1 (4 observations, 2 actions); use ``functools.partial``."""
    return MLPStepPolicy(obs_dim=4, n_actions=2, hidden=hidden, seed=seed)
