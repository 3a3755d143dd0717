"""PPO over `SampleFragment`s, in one readable file: the learner, GAE, and the loop.

The network is :class:`rollhub.inference.actor_critic.ActorCritic` (the fleet runs a numpy forward pass of the
same weights, :class:`rollhub.inference.mlp_policy.MLPStepPolicy`); the loss is in :mod:`rollhub.train.ppo_loss`.

The loop (:func:`train_ppo`) reads top to bottom: take a batch of fragments from the source, run one PPO update
on all of it, publish the next weight version. The policy version is the number of updates published (initial
weights: 0), so version ``k`` is published after update ``k``. Where the fragments come from (a Ray
replay-buffer actor, :mod:`rollhub.train.sources`) and how the weights travel
(:class:`rollhub.weights.WeightPublisher`) are arguments. The loop applies no staleness bound: the replay
buffer's own guard (compared against the versions the loop publishes to it) and the workers' admission apply it
before a batch is served; the loop measures the lag of what it trains on (``staleness``, ``max_staleness_seen``).

How the pieces of a fragment enter the loss:

* GAE uses the behaviour critic's values stored in the fragment. After the last step the value is the
  fragment's ``bootstrap_value`` (the extra ``fragment_length + 1``-th step). Where ``terminated[t]`` the next
  value is 0; where ``truncated[t]`` the episode was cut, so the next value is ``final_values[t]`` (the
  value of the episode's last observation): truncation bootstraps, termination does not. The advantage
  recursion stops at both, because the next stored observation belongs to a new episode.
* The importance ratio is taken against the stored behaviour log-probs, so data produced by a policy a few
  versions old is corrected and clipped the same way as on-policy data.
* The learning rate and the clip range can follow linear schedules over the environment steps trained on
  (:attr:`PPOLearner.trained_steps`, checkpointed with the learner, so a resumed run continues its schedule);
  the per-minibatch loss is :func:`rollhub.train.ppo_loss.ppo_loss`, differentiated by autograd (or, with
  ``backend="numpy"``, by the hand-written gradients of :mod:`rollhub.train.ppo_numpy`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from rollhub.experience import SampleFragment
from rollhub.inference.actor_critic import ActorCritic, numpy_weights
from rollhub.train.adam import Adam
from rollhub.train.checkpointing import load_training_arrays, training_arrays
from rollhub.train.ppo_loss import (
    LossSettings,
    LossStats,
    Minibatch,
    clip_grad_norm,
    linear_schedule,
    minibatch_bounds,
    ppo_loss,
)
from rollhub.train.sources import FragmentSource
from rollhub.weights.base import WeightPublisher


@dataclass(frozen=True)
class PPOConfig:
    """PPO hyperparameters (defaults tuned for CartPole-v1 with batches of a few thousand steps).

    Attributes:
        hidden: width of the two tanh layers of the actor and of the critic.
        lr, lr_final: Adam learning rate, moved linearly to ``lr_final`` over ``anneal_steps`` trained
            environment steps and held there afterwards (``lr_final=None``: constant ``lr``).
        clip, clip_final: the surrogate's ratio clip range, scheduled the same way (``None``: constant).
        anneal_steps: the horizon of both schedules, in trained environment steps (samples trained on).
        gamma, gae_lambda: discount and GAE lambda.
        clip_vf: value clipping: the critic's prediction is also clipped to within ``clip_vf`` of the behaviour
            critic's value and the larger squared error counts (``None``: no value clipping).
        vf_coef, ent_coef: weights of the value loss and of the entropy bonus.
        epochs: passes over each batch.
        minibatches: minibatches per epoch (``None``: 4, unless ``minibatch_size`` is set).
        minibatch_size: samples per minibatch (the last of an epoch may be smaller); excludes ``minibatches``.
        norm_adv: normalise advantages to zero mean and unit std within each minibatch.
        max_grad_norm: the global gradient norm is clipped to this before each optimizer step.
        seed: seeds the initial weights and the minibatch shuffling.
        backend: how each minibatch's gradients are taken: ``"autograd"`` (``backward()`` on
            :func:`rollhub.train.ppo_loss.ppo_loss`) or ``"numpy"`` (the same loss differentiated by hand,
            :func:`rollhub.train.ppo_numpy.ppo_gradients`: faster on small networks).
    """

    hidden: int = 64
    lr: float = 1e-3
    lr_final: float | None = None
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    clip_final: float | None = None
    anneal_steps: int = 100_000
    clip_vf: float | None = None
    vf_coef: float = 0.5
    ent_coef: float = 0.0
    epochs: int = 4
    minibatches: int | None = None
    minibatch_size: int | None = None
    norm_adv: bool = True
    max_grad_norm: float = 0.5
    seed: int = 0
    backend: Literal["autograd", "numpy"] = "autograd"

    def __post_init__(self) -> None:
        if self.backend not in ("autograd", "numpy"):
            raise ValueError(f"PPOConfig: backend must be 'autograd' or 'numpy' (got {self.backend!r})")
        if self.minibatches is not None and self.minibatch_size is not None:
            raise ValueError("PPOConfig: minibatches and minibatch_size are both set; set one of them")
        for name in ("minibatches", "minibatch_size", "anneal_steps", "epochs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"PPOConfig: {name} must be >= 1 (got {value})")


def compute_gae(fragment: SampleFragment, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and value targets (returns) of one fragment; see the module docstring for the rules."""
    values = fragment.values.astype(np.float64)
    next_values = np.append(values[1:], fragment.bootstrap_value)
    next_values = np.where(fragment.truncated, fragment.final_values, next_values)
    next_values = np.where(fragment.terminated, 0.0, next_values)
    episode_ends = fragment.terminated | fragment.truncated
    deltas = fragment.rewards + gamma * next_values - values
    advantages = np.zeros_like(values)
    running = 0.0
    for t in reversed(range(fragment.length)):
        running = deltas[t] + gamma * lam * (0.0 if episode_ends[t] else 1.0) * running
        advantages[t] = running
    return advantages.astype(np.float32), (advantages + values).astype(np.float32)


class PPOLearner:
    """Owns the trainable :class:`ActorCritic` and its optimizer; :meth:`update` is one PPO iteration."""

    def __init__(self, obs_dim: int, n_actions: int, config: PPOConfig | None = None) -> None:
        torch.set_num_threads(1)  # and numpy's BLAS (the gradients): one thread beside the fleet's processes
        threadpool_limits(1, user_api="blas")
        self.config = config or PPOConfig()
        torch.manual_seed(self.config.seed)
        self.model = ActorCritic(obs_dim, n_actions, self.config.hidden)
        self.optimizer = Adam(self.model.parameters(), lr=self.config.lr, eps=1e-5)  # no torch._dynamo import
        self.rng = np.random.default_rng(self.config.seed)
        self.trained_steps = 0  # samples trained on: the position of the lr and clip schedules

    def weights(self) -> dict[str, np.ndarray]:
        """Current parameters as numpy arrays."""
        return numpy_weights(self.model)

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Everything needed to continue training exactly: arrays (model, optimizer moments, torch RNG; see
        :mod:`rollhub.train.checkpointing`) and JSON-able values (optimizer hyperparameters, the numpy
        minibatch RNG, the schedules' position ``trained_steps``)."""
        arrays, param_groups = training_arrays(self.model, self.optimizer)
        values = {"param_groups": param_groups, "numpy_rng": self.rng.bit_generator.state}
        return arrays, values | {"trained_steps": self.trained_steps}

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], values: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        load_training_arrays(self.model, self.optimizer, arrays, values["param_groups"])
        self.rng.bit_generator.state = values["numpy_rng"]
        self.trained_steps = int(values.get("trained_steps", 0))  # checkpoints from before the schedules: 0

    def schedule(self) -> tuple[float, float]:
        """The learning rate and clip range the next update uses (they depend on ``trained_steps``)."""
        cfg = self.config
        return (
            linear_schedule(cfg.lr, cfg.lr_final, cfg.anneal_steps, self.trained_steps),
            linear_schedule(cfg.clip, cfg.clip_final, cfg.anneal_steps, self.trained_steps),
        )

    def update(self, fragments: Sequence[SampleFragment]) -> dict[str, float]:
        """Run ``epochs`` passes of clipped-PPO minibatch steps on ``fragments``; return loss statistics and
        the ``lr`` and ``clip`` used (both follow their schedules over ``trained_steps``).

        Each step takes the gradients of :func:`rollhub.train.ppo_loss.ppo_loss` (through autograd, or by hand
        with ``backend="numpy"``), clips their global norm to ``max_grad_norm`` and takes an :class:`Adam` step."""
        cfg = self.config
        lr, clip = self.schedule()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        settings = LossSettings(clip, cfg.clip_vf, cfg.vf_coef, cfg.ent_coef, cfg.norm_adv)
        gae = [compute_gae(f, cfg.gamma, cfg.gae_lambda) for f in fragments]

        def joined(arrays: list[np.ndarray], dtype: type) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(arrays).astype(dtype, copy=False))

        data = Minibatch(
            obs=joined([f.obs for f in fragments], np.float32),
            actions=joined([f.actions for f in fragments], np.int64),
            behaviour_logp=joined([f.logp for f in fragments], np.float32),
            behaviour_value=joined([f.values for f in fragments], np.float32),
            advantages=joined([a for a, _ in gae], np.float32),
            returns=joined([r for _, r in gae], np.float32),
        )
        step = self._numpy_step if cfg.backend == "numpy" else self._autograd_step
        n = data.obs.shape[0]
        bounds = minibatch_bounds(n, cfg.minibatches, cfg.minibatch_size)
        stats: dict[str, list[float]] = {"policy_loss": [], "value_loss": [], "entropy": [], "clip_frac": []}
        for _ in range(cfg.epochs):
            order = torch.from_numpy(self.rng.permutation(n))
            for start, stop in bounds:
                terms = step(data.rows(order[start:stop]), settings)
                for key in stats:
                    stats[key].append(getattr(terms, key))
        self.trained_steps += n
        return {k: float(np.mean(v)) for k, v in stats.items()} | {"samples": float(n), "lr": lr, "clip": clip}

    def _autograd_step(self, batch: Minibatch, settings: LossSettings) -> LossStats:
        """One optimizer step on ``batch`` with the gradients of ``backward()``."""
        self.optimizer.zero_grad()
        loss, terms = ppo_loss(self.model, batch, settings)
        loss.backward()
        clip_grad_norm([p.grad for p in self.optimizer.params], self.config.max_grad_norm)
        self.optimizer.step()
        return terms

    def _numpy_step(self, batch: Minibatch, settings: LossSettings) -> LossStats:
        """One optimizer step on ``batch`` with the hand-written gradients of ``rollhub.train.ppo_numpy``, taken
        on numpy views of the parameters (the :class:`Adam` step updates them in place, so the views see it)."""
        from rollhub.train.ppo_numpy import clip_global_norm, numpy_layers, ppo_gradients

        actor, critic = numpy_layers(self.model.actor), numpy_layers(self.model.critic)
        grads, terms = ppo_gradients(actor, critic, batch, settings)
        clip_global_norm(grads, self.config.max_grad_norm)
        for p, g in zip(self.optimizer.params, grads, strict=True):
            p.grad = torch.from_numpy(g)
        self.optimizer.step()
        return terms


@dataclass
class PPOState:
    """Where a PPO run stands; checkpointed with the learner so a resumed run continues its counts.

    Attributes:
        version: the policy version published last (= optimizer updates published; initial weights: 0).
        trained_steps: environment steps trained on.
        max_staleness_seen: the largest ``version - policy_version`` of a fragment trained on.
    """

    version: int = 0
    trained_steps: int = 0
    max_staleness_seen: int = 0

    @classmethod
    def restore(cls, values: Mapping[str, Any]) -> PPOState:
        """The state a checkpoint saved; keys this version no longer keeps (``stale_dropped``, the count of a
        trainer-side staleness filter that no longer exists) are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def train_ppo(
    learner: PPOLearner,
    source: FragmentSource,
    publisher: WeightPublisher,
    state: PPOState,
    *,
    stop_reason: Callable[[], str | None],
    after_update: Callable[[PPOState, dict[str, float]], str | None],
    wait_s: float = 2.0,
) -> str:
    """Train until ``stop_reason()`` (checked before every batch) or ``after_update`` (after every published
    version: metrics, checkpoints, the target) names a reason; return that reason.

    The weights of ``state.version`` are published first, so producers can start (a resumed run publishes
    the version it was checkpointed at). Every batch the source serves is trained on whole (no staleness filter
    here: see the module docstring); ``staleness`` in the update's figures is its largest lag.
    """
    publisher.publish(state.version, learner.weights())
    source.publish_version(state.version)
    while (reason := stop_reason()) is None:
        fragments = source.next_batch(wait_s)
        if not fragments:
            continue
        lag = max(state.version - f.min_version for f in fragments)

        stats = learner.update(fragments)  # the loss: PPOLearner.update
        state.version += 1
        publisher.publish(state.version, learner.weights())
        source.publish_version(state.version)

        state.trained_steps += sum(f.length for f in fragments)
        state.max_staleness_seen = max(state.max_staleness_seen, lag)
        reason = after_update(state, stats | {"staleness": float(lag)})
        if reason is not None:
            return reason
    return reason
