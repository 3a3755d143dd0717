"""GRPO on groups of completions, read top to bottom: batch -> advantages -> clipped loss -> step -> publish.

The trainer consumes :class:`~rollhub.experience.Group` objects, the type every transport hands over (the
buffer server's ``GET /batch`` through ``TrainerClient``, JSON or msgpack; an in-process queue; a rollout
file): ``tokens``, ``masks`` (``-100`` on prompt positions), ``scores``, ``inference_logprobs`` (``1.0`` on
prompt positions; optional), ``advantages`` (optional, per token) and ``policy_version``. One group is the
completions of one prompt. What the trainer does for a group without ``inference_logprobs`` or with
``advantages`` of its own is in :mod:`rollhub.train.grpo_loss`. The model is any causal
LM: the built-in tiny transformer or a Hugging Face ``AutoModelForCausalLM`` (whose ``state_dict`` names, e.g.
``lm_head.weight``, are what :meth:`GRPOTrainer.weights` publishes, so an inference engine can reload them).

The trainer's clock is its *policy version*: the number of weight updates it has published (initial
weights: 0; after its ``k``-th optimizer update it publishes version ``k``). The trainer applies no staleness
bound: it trains on every group its source serves and measures how far behind that clock each one is (the lag,
:meth:`~rollhub.experience.StalenessPolicy.lag`). The bound is applied once per path before the batch is served:
by the buffer's own guard (``rollhub serve --max-staleness``) and by the producers' admission, or, where the
buffer has no guard (an AtroposLib server), by the source (:class:`rollhub.run.sources.ServerGroupSource`).

1. Advantages are group-relative: each completion's score minus its group's mean, divided by the group's
   standard deviation (plus ``eps``). A group whose scores are all equal teaches nothing and gets zero. They are
   computed within each group as it is served, whatever its size: a group of another size than
   ``GRPOConfig.group_size`` (counted in episodes for a group of multi-turn episodes) is trained the same way and
   counted in ``off_size_groups`` (a group of one sequence has no spread, so it teaches nothing unless it sends
   advantages of its own).
2. The log-probs are of the distribution that sampled each token: each group's ``generation_params``
   (temperature, top-p, top-k, min-p) are applied to the trainer's logits as the sampler applied them
   (:func:`~rollhub.train.grpo_loss.sampled_logprobs`), with dropout off.
3. The loss is PPO's clipped surrogate per completion token under a named off-policy correction
   (``GRPOConfig.correction``, :mod:`rollhub.train.offpolicy`): by default (``tis``) the ratio is taken against
   the proximal policy (the trainer's own log-probs before the update) and each token's term is weighted by the
   detached, truncated importance weight ``min(pi_prox / mu, 2)`` against the behaviour log-probs ``mu`` (the
   sampler's ``inference_logprobs``), so data sampled by older weights (up to the run's ``writer.max_staleness``
   versions) is corrected rather than treated as on-policy. ``dual_clip`` (3) bounds a negative advantage's term at
   ``dual_clip * A`` (dual-clip PPO), a separate knob. Every update reports ``ess_fraction``,
   ``capped_fraction``, ``masked_fraction``, ``clip_fraction_pos`` / ``clip_fraction_neg``,
   ``dual_clip_fraction`` and ``version_lag_mean`` / ``version_lag_max`` of the trained tokens.
4. Tokens are averaged over every completion token of the batch (prompt positions never count).
5. Optionally (``distill_coef`` > 0), the mean KL toward a teacher's top-k distribution that the groups send
   (:mod:`rollhub.train.distill`) is added, weighted by ``distill_coef``; ``distill_kl`` reports it.

Every step also reports the *train-inference mismatch*, measured in the first epoch's forward pass (the one
the loss uses, before any update on the batch) on the completion tokens of the groups sampled by exactly the
trainer's current version (and unversioned ones): there the trainer and the sampler should hold the same
weights, so ``logp_trainer`` and ``logp_behaviour`` differ only by how each side computes them (or because the
engine never received those weights). ``mismatch_abs`` is the mean ``|logp_trainer - logp_behaviour|``,
``mismatch_kl`` the mean of ``(r - 1) - log r`` (the k3 estimate of KL(behaviour || trainer) from the
behaviour's samples), ``mismatch_tokens`` the tokens measured. When no
token qualifies (every group is older), only ``mismatch_tokens = 0`` is reported: the two figures are left
out rather than written as NaN, which strict JSON readers of ``metrics.jsonl`` refuse. Above ``mismatch_warn``
a warning is logged: the engine computes different numbers from the same weights (other precision or kernels)
or does not hold the weights the trainer thinks it does.

:func:`train_grpo` is the loop every group run uses (``rollhub run`` with ``trainer.kind = "grpo"``): pull a
batch of groups from a :class:`GroupSource`, step on all of it, publish, tell the source the version.
The batch and the loss live in :mod:`rollhub.train.grpo_loss` and are re-exported here.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from rollhub.errors import InvalidInput, RollhubError
from rollhub.experience import Group, StalenessPolicy
from rollhub.experience.episodes import episode_count
from rollhub.models.sampling import Distribution
from rollhub.train.checkpointing import load_training_arrays, training_arrays
from rollhub.train.grpo_loss import (
    DEFAULT_CHUNK_ELEMENTS,
    DEFAULT_DUAL_CLIP,
    UNVERSIONED,
    SampledLogprobs,
    TokenBatch,
    group_advantages,
    groups_to_batch,
    grpo_loss,
    mismatch_stats,
    sampled_logprobs,
)
from rollhub.train.offpolicy import DEFAULT_PRESET, PRESETS, Correction
from rollhub.train.precision import compute_autocast

__all__ = [
    "GRPOConfig",
    "GRPOState",
    "GRPOTrainer",
    "GroupSource",
    "SampledLogprobs",
    "TokenBatch",
    "TrainingError",
    "group_advantages",
    "groups_to_batch",
    "grpo_loss",
    "mismatch_stats",
    "sampled_logprobs",
    "train_grpo",
]

logger = logging.getLogger(__name__)


class TrainingError(RollhubError):
    """The trainer was given a batch or setting it cannot train on."""


@dataclass(frozen=True, slots=True)
class GRPOConfig:
    """Hyper-parameters of :class:`GRPOTrainer`.

    Attributes:
        lr: Adam learning rate.
        clip_eps: the importance ratio is clipped to ``[1 - clip_eps, 1 + clip_eps]``.
        adv_eps: added to the group standard deviation before dividing.
        epochs: optimizer passes over each batch.
        max_grad_norm: gradients are clipped to this global norm.
        entropy_coef: weight of an entropy bonus on completion tokens (keeps small groups from collapsing
            onto one answer before the reward has told them apart).
        anneal_steps: over this many steps the learning rate and the entropy weight fall along a cosine to
            ``lr_final`` and ``entropy_coef_final`` and stay there (0: both stay constant).
        lr_final: the learning rate after ``anneal_steps`` (None: ``lr``).
        entropy_coef_final: the entropy weight after ``anneal_steps`` (None: ``entropy_coef``).
        correction: the off-policy correction (:mod:`rollhub.train.offpolicy`; default the ``tis`` preset).
        dual_clip: dual-clip PPO's bound on negative-advantage terms (``c * A``); must exceed ``1 + clip_eps``;
            ``None``: off.
        sampling: the distribution of groups that record no ``generation_params``.
        chunk_elements: logits per block in the loss (:func:`~rollhub.train.grpo_loss.sampled_logprobs`;
            ``None``: all at once).
        mismatch_warn: log a warning when a step's ``mismatch_abs`` (mean ``|logp_trainer - logp_behaviour|``
            on data of the trainer's own version) exceeds this; ``None``: never warn.
        group_size: the group size batches are counted in (the run's ``env.group_size``); groups of another size
            are trained all the same and counted in ``off_size_groups`` (``None``: not counted).
        distill_coef: weight of the KL toward a teacher's top-k that groups send (``distill_token_ids``,
            ``distill_logprobs``; :mod:`rollhub.train.distill`); 0: off, the fields are not read.
    """

    lr: float = 3e-3
    clip_eps: float = 0.2
    adv_eps: float = 1e-4
    epochs: int = 1
    max_grad_norm: float = 1.0
    entropy_coef: float = 0.0
    anneal_steps: int = 0
    lr_final: float | None = None
    entropy_coef_final: float | None = None
    correction: Correction = PRESETS[DEFAULT_PRESET]
    dual_clip: float | None = DEFAULT_DUAL_CLIP
    sampling: Distribution = field(default_factory=Distribution)
    chunk_elements: int | None = DEFAULT_CHUNK_ELEMENTS
    mismatch_warn: float | None = 0.05
    group_size: int | None = None
    distill_coef: float = 0.0

    def __post_init__(self) -> None:
        if not self.distill_coef >= 0:
            raise InvalidInput(f"distill_coef {self.distill_coef} must be >= 0 (0: off)", field="distill_coef")
        if self.dual_clip is not None and not self.dual_clip > 1 + self.clip_eps:
            raise InvalidInput(
                f"dual_clip {self.dual_clip} must exceed 1 + clip_eps = {1 + self.clip_eps} (at or below it, it "
                "would cut into PPO's own clip range); raise it, or None for no dual clip",
                field="dual_clip",
            )
        if self.mismatch_warn is not None and not self.mismatch_warn > 0:
            raise InvalidInput(
                f"mismatch_warn {self.mismatch_warn} must be > 0 (or None: never warn)", field="mismatch_warn"
            )
        if self.chunk_elements is not None and self.chunk_elements < 1:
            raise InvalidInput(f"chunk_elements {self.chunk_elements} must be >= 1 (or None)", field="chunk_elements")

    def annealed(self, start: float, final: float | None, step: int) -> float:
        """``start`` moved along a half cosine toward ``final`` at ``step`` (see ``anneal_steps``)."""
        if final is None or self.anneal_steps <= 0:
            return start
        done = min(1.0, step / self.anneal_steps)
        return final + (start - final) * 0.5 * (1.0 + math.cos(math.pi * done))


_CLOCK = StalenessPolicy()  # no bound: the trainer only measures the lag of what it trains on


class GRPOTrainer:
    """Owns the model and optimizer; ``step`` trains on one batch of groups and publishes the next version.

    ``step`` trains on every group it is given: the staleness bound was applied before the batch was served
    (see the module docstring); the step reports the lag (``staleness``, ``mean_staleness``,
    ``version_lag_mean`` / ``version_lag_max``).

    ``step_count`` is the trainer's policy version: the number of updates made and published. Publishing is
    a callback (``publish(version, state_dict)``) so the same trainer feeds the Ray object store, a
    checkpoint directory or an in-process policy.

    ``compute_dtype`` (``bfloat16`` or ``float16``; ``None``: float32) runs the loss's forward pass under
    autocast in that dtype while the model, its gradients and Adam stay float32: the mixed-precision scheme of
    :mod:`rollhub.train.precision` (``Precision.compute_dtype``). The model must then hold float32 weights.
    """

    def __init__(
        self,
        model: nn.Module,
        config: GRPOConfig,
        publish: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        self.publish = publish
        self.step_count = 0
        self.sampled_with: dict[str, Any] | None = None  # generation_params of the newest batch trained on
        self.compute_dtype = compute_dtype  # mixed precision: the loss's forward under autocast (precision.py)

    @property
    def policy_version(self) -> int:
        """The version of the weights last published (= ``step_count``)."""
        return self.step_count

    def step(self, groups: Sequence[Group]) -> dict[str, float]:
        """Train on every one of ``groups`` (no staleness filter: see the class docstring), publish the new
        weights, and return metrics.

        Raises:
            TrainingError: the groups cannot form a batch (nothing trained, the version unchanged).
        """
        groups = list(groups)
        try:
            batch = groups_to_batch(groups, self.config.adv_eps, self.config.sampling, self.config.distill_coef > 0)
        except InvalidInput as exc:
            raise TrainingError(f"cannot train on this batch: {exc}") from None
        cfg = self.config
        lr = cfg.annealed(cfg.lr, cfg.lr_final, self.step_count)
        entropy_coef = cfg.annealed(cfg.entropy_coef, cfg.entropy_coef_final, self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.eval()  # no dropout: the log-probs must be of the policy that is published
        started = time.perf_counter()
        stats: dict[str, float] = {}
        for epoch in range(cfg.epochs):
            # the mismatch is measured before any update on this batch: only the first epoch returns it, and
            # the later epochs' update() keeps it while replacing the loss figures with the last epoch's
            version = self.step_count if epoch == 0 else None
            with compute_autocast(self.model, self.compute_dtype):  # the forward only; backward below, outside
                loss, epoch_stats = grpo_loss(self.model, batch, cfg.clip_eps, entropy_coef, cfg.correction,
                                              cfg.dual_clip, version, cfg.chunk_elements,
                                              cfg.distill_coef)  # fmt: skip
            stats.update(epoch_stats)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            self.optimizer.step()
        lags = [_CLOCK.lag(g.policy_version, self.step_count) for g in groups if g.policy_version is not None]
        token_lags = self._token_lags(batch)
        self.sampled_with = groups[-1].meta.get("generation_params") or self.config.sampling.as_params()
        self.step_count += 1
        stats.update(
            grad_norm=float(grad_norm),
            lr=lr,
            entropy_coef=entropy_coef,
            staleness=float(max(lags, default=0)),
            mean_staleness=float(np.mean(lags)) if lags else 0.0,
            mean_score=float(np.concatenate([g.scores for g in groups]).mean()),
            completion_tokens=float(batch.loss_mask.sum()),
            off_size_groups=float(sum(cfg.group_size not in (None, episode_count(g)) for g in groups)),
            version_lag_mean=float(token_lags.mean()) if token_lags.size else 0.0,
            version_lag_max=float(token_lags.max()) if token_lags.size else 0.0,
        )
        self._warn_on_mismatch(stats, self.step_count - 1)
        trained = time.perf_counter()
        self.publish_current()
        stats.update(train_s=trained - started, publish_s=time.perf_counter() - trained)
        return stats

    def _token_lags(self, batch: TokenBatch) -> np.ndarray:
        """``trainer version - policy_version`` of every trained completion token of a versioned sequence."""
        versions = batch.policy_versions
        counts = batch.loss_mask.sum(dim=1).numpy().astype(np.int64)
        versioned = versions != UNVERSIONED
        return np.repeat(self.step_count - versions[versioned], counts[versioned])

    def _warn_on_mismatch(self, stats: dict[str, float], version: int) -> None:
        limit, value = self.config.mismatch_warn, stats.get("mismatch_abs")
        if limit is None or value is None or value <= limit:
            return
        logger.warning(
            "train-inference mismatch at policy version %d: mismatch_abs %.4g > mismatch_warn %.4g "
            "(mismatch_kl %.4g over %d tokens sampled by this very version). The sampler's log-probs differ from "
            "the trainer's for the same weights: likely a different precision or different kernels in the "
            "inference engine and the trainer (e.g. bfloat16 against float32), or weights that did not reach "
            "the engine (it still samples from older ones). The ratio against the engine's log-probs still "
            "corrects the loss, but a large gap means more clipped and capped tokens and noisier updates.",
            version,
            value,
            limit,
            stats["mismatch_kl"],
            int(stats["mismatch_tokens"]),
        )

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the current weights (what :attr:`publish` receives)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def publish_current(self) -> None:
        """Publish the weights of the current version (version 0 before training; a resumed run's version)."""
        if self.publish is not None:
            self.publish(self.step_count, self.weights())

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Everything needed to continue training exactly: arrays (``model.*`` weights, ``optim.*`` Adam moments,
        the torch RNG; see :mod:`rollhub.train.checkpointing`) and JSON-able values (the version, the optimizer's
        settings)."""
        arrays, param_groups = training_arrays(self.model, self.optimizer)
        return arrays, {"version": self.step_count, "param_groups": param_groups}

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], values: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        load_training_arrays(self.model, self.optimizer, arrays, values["param_groups"])
        self.step_count = int(values["version"])
        self.model.eval()


class GroupSource(Protocol):
    """Where the GRPO loop's batches come from: the buffer server over HTTP
    (:class:`rollhub.run.sources.ServerGroupSource`) or an in-process queue fed by a local rollout
    manager (:class:`rollhub.run.sources.InProcessGroupSource`).

    A source serves batches the trainer trains on whole. Where the buffer behind it applies the staleness
    bound (the buffer server's ``--max-staleness``), the source applies none; where it does not (an AtroposLib
    server), the source applies the bound itself, once, to each batch it serves, and counts what it left out.

    Attributes:
        stale_groups: groups the source left out as too stale (0 where the buffer behind it has the guard).
        batches_skipped: served batches the source acknowledged without handing out (every group too stale).
    """

    stale_groups: int
    batches_skipped: int

    def next_batch(self, wait_s: float) -> Sequence[Group] | None:
        """The next batch of whole groups, waiting up to ``wait_s`` seconds; ``None`` if none came."""
        ...

    def ack(self) -> None:
        """The batch served last is done with (trained on): it must not be served again."""
        ...

    def publish_version(self, version: int) -> None:
        """The trainer now holds policy ``version``; the source's staleness bound compares against it."""
        ...


@dataclass
class GRPOState:
    """What the GRPO loop has seen; checkpointed with the trainer so a resumed run continues its counts.

    Attributes:
        batches: batches received: those trained on (each one whole, as the source served it) and those the
            source skipped.
        skipped: batches the source skipped (every group too stale; only a source whose buffer has no
            staleness guard skips any).
        stale_groups: groups the source left out as too stale (likewise).
        trained_sequences: sequences (completions) trained on.
        max_staleness_seen: the largest ``trainer version - policy_version`` of a group trained on.
        staleness: per trained group, that difference (the newest 1,000 groups).
    """

    batches: int = 0
    skipped: int = 0
    stale_groups: int = 0
    trained_sequences: int = 0
    max_staleness_seen: int = 0
    staleness: list[int] = field(default_factory=list)


def train_grpo(
    trainer: GRPOTrainer,
    source: GroupSource,
    state: GRPOState,
    *,
    stop_reason: Callable[[], str | None],
    after_update: Callable[[GRPOState, dict[str, float]], str | None],
    wait_s: float = 2.0,
) -> str:
    """Train until ``stop_reason()`` (checked before every batch) or ``after_update`` (after every published
    version: evaluation, metrics, checkpoints, the target) names a reason; return that reason.

    The weights of the trainer's version are published first, so producers can start. Every batch the source
    serves (any ``Sequence[Group]``) is trained on whole: the loop applies no staleness bound, it measures the
    lag of each group and adds up what the source left out (``stale_groups``, ``skipped``).
    """
    trainer.publish_current()
    source.publish_version(trainer.policy_version)
    waited = 0.0  # seconds spent waiting for the batch the next update trains on
    left_out = 0  # groups the source left out since the last update
    dropped, skipped = source.stale_groups, source.batches_skipped
    while (reason := stop_reason()) is None:
        asked = time.perf_counter()
        groups = source.next_batch(wait_s)
        waited += time.perf_counter() - asked
        left_out += source.stale_groups - dropped
        state.stale_groups += source.stale_groups - dropped
        state.skipped += source.batches_skipped - skipped
        state.batches += source.batches_skipped - skipped
        dropped, skipped = source.stale_groups, source.batches_skipped
        if not groups:
            continue
        state.batches += 1
        lags = [_CLOCK.lag(g.policy_version, trainer.policy_version) for g in groups]

        stats = trainer.step(groups)  # the loss: grpo_loss; publishes version + 1 through trainer.publish
        source.ack()
        source.publish_version(trainer.policy_version)

        state.trained_sequences += sum(g.size for g in groups)
        state.max_staleness_seen = max(state.max_staleness_seen, *lags)
        state.staleness = [*state.staleness, *lags][-1000:]
        reason = after_update(state, stats | {"stale_groups": float(left_out), "wait_s": waited})
        waited, left_out = 0.0, 0
        if reason is not None:
            return reason
    return reason
