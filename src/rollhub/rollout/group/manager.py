"""The group rollout manager: it computes (inference, environments) and never coordinates.

:class:`GroupRolloutManager` implements :class:`~rollhub.rollout.protocols.RolloutManager` for group
(LLM-style) environments. Everything that varies between calls comes in the
:class:`~rollhub.rollout.protocols.SampleRequest` (lesson, mode, prompt count, seed, loaded policy version,
worker id), so a test can call :meth:`GroupRolloutManager.sample_batch` with no worker, no weight transport,
no curriculum and no storage. The :class:`~rollhub.rollout.worker.RolloutWorker` decides which lesson to sample
and when to evaluate, stores the groups, reports :attr:`SampleResult.stats` to the curriculum and logs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from rollhub.curriculum.config import CurriculumConfig, LessonConfig
from rollhub.envs.group.base import GroupEnv
from rollhub.envs.group.scored import GroupStats, stamp
from rollhub.envs.group.spec import load_environment_from_spec
from rollhub.errors import ConfigError, RollhubError
from rollhub.inference.base import Closeable, Completion, InferenceContext, SamplingParams, WeightLoading
from rollhub.inference.override import unwrapped
from rollhub.rollout.protocols import SampleRequest, SampleResult

logger = logging.getLogger(__name__)


class ManagerError(RollhubError):
    """A call the manager cannot serve: a policy without weight swapping, or a manager already shut down."""


class _AbortCounter:
    """The policy as an environment sees it during one ``sample_batch`` call: it counts the aborted completions
    it hands out, so the manager reports them whatever the environment does with them.

    Attributes:
        completions: completions with ``finish_reason == "abort"`` returned so far.
        prompts: prompts that had at least one of them (each costs its environment a group).
    """

    def __init__(self, inner: InferenceContext) -> None:
        self._inner = inner
        self.completions = 0
        self.prompts = 0

    def complete(
        self, prompts: list[str], n: int, params: SamplingParams, rng: np.random.Generator
    ) -> list[list[Completion]]:
        """The wrapped policy's completions, counted (see :class:`~rollhub.inference.base.InferenceContext`)."""
        out = self._inner.complete(prompts, n, params, rng)
        for comps in out:
            aborted = sum(c.finish_reason == "abort" for c in comps)
            self.completions += aborted
            self.prompts += aborted > 0
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class GroupRolloutManager:
    """Samples groups of completions from curriculum lessons with one policy.

    Every group it returns is a :class:`~rollhub.experience.Group` tagged with the request's
    ``policy_version`` (the weights loaded), ``worker_id`` and the time (see :mod:`rollhub.envs.group.scored`).

    Args:
        curriculum_config: the lessons (each names its environment by spec and its batch sizes).
        inference: the policy; :meth:`update_model` needs it to have ``load_weights(state)``.
        env_loader: builds an environment from ``(spec, args)``; environments are built once per lesson.
    """

    def __init__(
        self,
        curriculum_config: CurriculumConfig,
        inference: InferenceContext,
        env_loader: Callable[[str, dict[str, Any]], GroupEnv] = load_environment_from_spec,
    ) -> None:
        self.curriculum_config = curriculum_config
        self._inference: InferenceContext | None = inference
        self._env_loader = env_loader
        self._environments: dict[str, GroupEnv] = {}

    def lesson(self, lesson_id: str) -> LessonConfig:
        """The lesson's settings (``n_examples`` and ``n_generations`` are what a training call uses)."""
        return self.curriculum_config.lesson(lesson_id)

    def _load_environment(self, lesson_id: str) -> GroupEnv:
        env = self._environments.get(lesson_id)
        if env is None:
            lesson = self.lesson(lesson_id)
            env = self._env_loader(lesson.env_spec, dict(lesson.env_args))
            self._environments[lesson_id] = env
        return env

    @property
    def inference(self) -> InferenceContext:
        """The policy (raises :class:`ManagerError` after :meth:`shutdown`)."""
        if self._inference is None:
            raise ManagerError("the manager was shut down; build a new GroupRolloutManager")
        return self._inference

    def sample_batch(self, request: SampleRequest) -> SampleResult:
        """Sample one lesson: ``n_examples`` groups (at most ``max_examples``) of the lesson's ``n_generations``
        completions in ``"train"`` mode, one greedy completion per prompt in ``"eval"`` mode.

        Returns:
            the groups in ``items`` (none when the environment produced none, or when the loaded
            ``policy_version`` is older than ``min_version``: then ``dropped_groups`` counts what was asked),
            their :class:`GroupStats` in ``stats``, the environment's metrics in ``metrics`` with
            ``aborted_completions`` (completions the policy returned with ``finish_reason == "abort"``, never
            scored or stored) and ``aborted_groups`` (prompts that had one, left out whole; see
            :mod:`rollhub.envs.group.scored`).

        Raises:
            ConfigError: the request names no lesson, or one the curriculum does not have.
            ManagerError: the manager was shut down.
        """
        if request.lesson_id is None:
            raise ConfigError("SampleRequest.lesson_id is None; a group manager needs the lesson to sample")
        lesson = self.lesson(request.lesson_id)
        n_examples = lesson.n_examples if request.n_examples is None else request.n_examples
        if request.max_examples is not None:
            n_examples = min(n_examples, request.max_examples)
        n_generations = lesson.n_generations if request.mode == "train" else 1
        if request.min_version is not None and request.policy_version < request.min_version:
            event = f"policy version {request.policy_version} is older than min_version {request.min_version}"
            return SampleResult(dropped_groups=n_examples, events=[event], stats=GroupStats.of([], lesson.lesson_id))
        env = self._load_environment(lesson.lesson_id)
        rng = np.random.default_rng(request.seed)
        counter = _AbortCounter(self.inference)
        groups, metrics = env.sample(counter, n_examples, n_generations, request.mode, rng)
        if not groups:
            logger.warning("lesson %s produced no groups (policy version %d)", lesson.lesson_id, request.policy_version)
        now = time.time()
        for group in groups:
            stamp(group, request.policy_version, request.worker_id, now)
        return SampleResult(
            items=list(groups),
            env_steps=sum(g.size for g in groups),
            metrics={
                **{k: float(v) for k, v in metrics.items()},
                "aborted_completions": float(counter.completions),
                "aborted_groups": float(counter.prompts),
            },
            stats=GroupStats.of(groups, lesson.lesson_id),
        )

    def update_model(self, weights: Mapping[str, Any]) -> None:
        """Swap the policy's weights in place (``weights`` is a state dict of tensors or arrays).

        Raises:
            ManagerError: the policy cannot swap weights (a remote server reloads its own).
        """
        policy = unwrapped(self.inference)
        if not isinstance(policy, WeightLoading):
            raise ManagerError(
                f"{type(policy).__name__} cannot load weights in place; have the inference server "
                "reload from a checkpoint directory instead"
            )
        policy.load_weights(weights)

    def shutdown(self) -> None:
        """Release the policy and environments; later calls raise :class:`ManagerError`."""
        policy = None if self._inference is None else unwrapped(self._inference)
        if isinstance(policy, Closeable):
            policy.close()
        self._inference = None
        self._environments.clear()
