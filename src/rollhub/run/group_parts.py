"""The parts of a group (LLM) run, each built from its own config section (and what the assembler,
:mod:`rollhub.run.assemble`, hands it): the curriculum and its probe, the transformer policy's shape, the
built-in policy backend (:class:`LocalBackend`; the vLLM engines are :class:`rollhub.run.llm.EngineBackend`),
the rollout managers it makes, the GRPO trainer, and the weight publisher.

Precision (:mod:`rollhub.train.precision`): the trainer's model holds float32 master weights whatever
``policy.dtype`` says; for ``bfloat16``/``float16`` the loss's forward runs under autocast in that dtype, and
:func:`publisher` casts each version to it before the engine push.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollhub.curriculum import CurriculumConfig, LessonConfig, LessonDependency
from rollhub.envs.episode.spec import BUILTIN_EPISODE_ENVS, build_episode_env
from rollhub.errors import ConfigError
from rollhub.inference.engine_idle import IdleCounts
from rollhub.inference.override import with_sampling
from rollhub.inference.tokenizer import CharTokenizer
from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer, TransformerConfig
from rollhub.rollout.group.manager import GroupRolloutManager
from rollhub.run.backend import PolicyBackend
from rollhub.run.config import RunConfig, RunConfigError
from rollhub.run.config_group import EpisodeSection, GRPOTrainerConfig, LessonSection, TransformerPolicyConfig
from rollhub.run.config_llm import TINY
from rollhub.run.rundir import Resumed
from rollhub.train.grpo import GRPOConfig, GRPOTrainer
from rollhub.train.precision import Precision
from rollhub.weights.checkpoint import CheckpointPublisher

EPISODES_SPEC = "episodes"  # rollhub.envs.group.spec's built-in spec of a multi-turn environment
ALL_EVAL_PROMPTS = 10**6  # eval.n_examples = None: every prompt an environment has for mode="eval"


def episode_of(config: RunConfig) -> EpisodeSection | None:
    """``[env.episode]`` of a run whose environment is a multi-turn one, else ``None``."""
    return getattr(config.env, "episode", None)


def episode_tokenizer(config: RunConfig) -> str:
    """Whose chat template renders an episode run's conversations: ``env.episode.tokenizer``, else the policy's
    model (for ``policy.model = "tiny"`` the directory the run builds it into, absolute, so every worker finds it)."""
    from rollhub.run.llm import MODEL_DIR

    episode = episode_of(config)
    if episode is not None and episode.tokenizer is not None:
        return episode.tokenizer
    if config.policy.model == TINY:
        return str(Path(config.run.dir).resolve() / MODEL_DIR)
    return config.policy.model


def _env_of_lesson(config: RunConfig, env_id: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The spec and arguments a lesson's environment is built from: as given, or for a multi-turn environment
    (``[env.episode]``) the built-in spec ``episodes`` wrapping it (:func:`rollhub.envs.episode.spec.episode_env`)
    with the run's episode budgets and tokenizer."""
    episode = episode_of(config)
    if episode is None:
        return env_id, kwargs
    limits = episode.model_dump(include={"max_tokens", "turn_max_tokens", "max_turns", "discount"})
    return EPISODES_SPEC, {"env": env_id, "tokenizer": episode_tokenizer(config), **limits, "env_kwargs": kwargs}


def _lesson(config: RunConfig, section: LessonSection | None) -> LessonConfig:
    env = config.env
    sizes = {"n_examples": config.trainer.groups_per_batch, "n_generations": env.group_size}
    if section is None:
        return LessonConfig(env.lesson, *_env_of_lesson(config, env.id, dict(env.kwargs)), **sizes)
    thresholds = {s.id: s.threshold for s in config.curriculum.lessons}
    dependencies = tuple(LessonDependency(d, thresholds.get(d, 0.8)) for d in section.depends_on)
    spec, kwargs = _env_of_lesson(config, section.env_id or env.id, {**env.kwargs, **section.kwargs})
    return LessonConfig(section.id, spec, kwargs, dependencies, graduate_threshold=section.graduate_threshold, **sizes)


def curriculum_config(config: RunConfig) -> CurriculumConfig | None:
    """The lessons of ``[curriculum]`` (or ``env``'s one lesson), sized by ``trainer`` and ``env.group_size``; for
    ``env.kind = "external"`` the one lesson rollhub evaluates on (``env.eval_id``), or ``None`` without one.

    Raises:
        RunConfigError: the lessons do not form a curriculum (a duplicate id, an unknown or cyclic dependency).
    """
    cur, env = config.curriculum, config.env
    if env.kind == "external":
        if env.eval_id is None:
            return None
        sizes = {"n_examples": config.trainer.groups_per_batch, "n_generations": env.group_size}
        lesson = LessonConfig(env.lesson, env.eval_id, dict(env.eval_kwargs), **sizes)
        return CurriculumConfig(lessons=(lesson,), eval_frequency=0, micro_eval_frequency=0)
    lessons = tuple(_lesson(config, section) for section in (cur.lessons or [None]))
    try:
        return CurriculumConfig(
            lessons=lessons, eval_frequency=cur.eval_every, micro_eval_frequency=0, eval_n_examples=cur.eval_examples
        )
    except ConfigError as exc:
        raise RunConfigError(f"curriculum.lessons: {exc}") from None


def probe_group_env(config: RunConfig) -> CurriculumConfig | None:
    """The curriculum (see :func:`curriculum_config`), with every lesson's environment built once here (then
    dropped).

    Raises:
        RunConfigError: a lesson's environment cannot be imported or built; the message names the key.
    """
    curriculum = curriculum_config(config)
    for i, lesson in enumerate(curriculum.lessons if curriculum is not None else ()):
        key = "env" if not config.curriculum.lessons else f"curriculum.lessons[{i}]"
        key = "env.eval_id" if config.env.kind == "external" else key
        if episode_of(config) is None and lesson.env_spec in BUILTIN_EPISODE_ENVS:
            raise RunConfigError(
                f"{key}: {lesson.env_spec!r} is a multi-turn environment; add an [env.episode] table (its budgets: "
                "max_tokens, turn_max_tokens, max_turns, discount) and use policy.kind = 'hf'"
            )
        try:
            _build_env(config, lesson)
        except ConfigError as exc:
            raise RunConfigError(f"{key}: {exc}; fix env.id or the kwargs") from None
        except Exception as exc:
            raise RunConfigError(
                f"{key}: building {lesson.env_spec!r} with {lesson.env_args} failed ({type(exc).__name__}: {exc})"
            ) from None
    return curriculum


def _build_env(config: RunConfig, lesson: LessonConfig) -> None:
    """Build ``lesson``'s environment once (then drop it). A multi-turn one is built without its chat template
    while the tiny model that holds it is not built yet (the run builds it, then the workers render with it).

    Raises:
        ConfigError: the environment cannot be imported or built.
    """
    from rollhub.envs.group.spec import load_environment_from_spec

    args, episode = dict(lesson.env_args), episode_of(config)
    tiny = episode is not None and episode.tokenizer is None and config.policy.model == TINY
    if tiny and not Path(args["tokenizer"]).exists():
        build_episode_env(args["env"], args["env_kwargs"])
        return
    load_environment_from_spec(lesson.env_spec, args)


def model_shape(policy: TransformerPolicyConfig) -> TransformerConfig:
    """The tiny transformer of ``[policy]`` over the character vocabulary."""
    vocab = CharTokenizer().vocab_size
    return TransformerConfig(vocab_size=vocab, d_model=policy.d_model, n_layers=policy.n_layers,
                             n_heads=policy.n_heads, max_len=policy.max_len)  # fmt: skip


def build_policy(shape: TransformerConfig, seed: int) -> LocalPolicy:
    """A freshly initialised tiny transformer (seeded), in eval mode, with the character tokenizer."""
    torch.manual_seed(seed)
    model = TinyTransformer(shape)
    model.eval()
    return LocalPolicy(model, CharTokenizer())


@dataclass(frozen=True)
class ManagerFactory:
    """Picklable ``worker_id -> GroupRolloutManager``, run inside each Ray worker process.

    ``sampling``: the run's ``[sampling]`` keys, laid over the environments' training requests."""

    curriculum: CurriculumConfig
    shape: TransformerConfig
    seed: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)

    def __call__(self, worker_id: str) -> GroupRolloutManager:
        torch.set_num_threads(1)  # small matrices; one thread per process keeps a few cores from thrashing
        return GroupRolloutManager(self.curriculum, with_sampling(build_policy(self.shape, self.seed), self.sampling))


def make_trainer(trainer: GRPOTrainerConfig, model: Any, resumed: Resumed | None, *, precision: Precision,
                 group_size: int, sampling: dict[str, Any]) -> GRPOTrainer:  # fmt: skip
    """The GRPO trainer of ``[trainer]`` on ``model`` (the backend's fresh copy, float32 master weights),
    restored from ``resumed``; with ``precision`` of a bfloat16/float16 policy the loss's forward runs under
    autocast in that dtype (:mod:`rollhub.train.precision`). The assembler hands it the group size and the
    ``[sampling]`` overrides (the staleness bound is applied by the producers and the buffer, not here).

    Raises:
        PrecisionError: ``model`` does not hold float32 weights.
    """
    from rollhub.models.sampling import Distribution
    from rollhub.train.offpolicy import preset

    t = trainer
    correction = preset(t.correction).with_values(t.correction_cap, t.correction_bounds)
    grpo = GRPOConfig(
        lr=t.lr, clip_eps=t.clip_eps, adv_eps=t.adv_eps, epochs=t.epochs,
        max_grad_norm=t.max_grad_norm, entropy_coef=t.entropy_coef, anneal_steps=t.anneal_steps, lr_final=t.lr_final,
        entropy_coef_final=t.entropy_coef_final, correction=correction, dual_clip=t.dual_clip,
        sampling=Distribution.from_params(sampling, where="sampling"),
        chunk_elements=t.logprob_chunk, mismatch_warn=t.mismatch_warn, group_size=group_size,
        distill_coef=t.distill_coef,
    )  # fmt: skip
    precision.check_master(model)
    out = GRPOTrainer(model, grpo, compute_dtype=precision.compute_dtype)
    if resumed is not None:
        out.load_state_dict(resumed.arrays, resumed.values["trainer"])
    return out


class LocalBackend:
    """The built-in tiny transformer (``policy.kind = "transformer"``): every process holds its own copy and
    loads published weights into it (see :class:`rollhub.run.llm.EngineBackend` for the engine path).

    Args:
        policy: the ``[policy]`` section.
        seed: the run's seed (every fresh copy starts from it).
        sampling: the ``[sampling]`` overrides laid over the environments' training requests.
    """

    def __init__(self, policy: TransformerPolicyConfig, seed: int = 0, sampling: dict[str, Any] | None = None) -> None:
        self.shape = model_shape(policy)
        self.seed = seed
        self.sampling = dict(sampling or {})

    def trainer_model(self) -> Any:
        """A freshly initialised copy (seeded by ``run.seed``)."""
        return build_policy(self.shape, self.seed).model

    def manager_factory(self, curriculum: CurriculumConfig) -> ManagerFactory:
        """Rollout managers with their own policy copy."""
        return ManagerFactory(curriculum, self.shape, self.seed, self.sampling)

    def evaluator(self, curriculum: CurriculumConfig) -> GroupRolloutManager:
        """A manager on a separate copy, loaded with the trainer's weights before each evaluation."""
        return self.manager_factory(curriculum)("eval")

    def load_eval_weights(self, evaluator: GroupRolloutManager, weights: Callable[[], dict[str, Any]]) -> None:
        """Load the trainer's current weights into the evaluator's copy."""
        evaluator.update_model(weights())

    def ships_weights(self) -> bool:
        """Yes: every rollout process holds its own copy and loads each published version's arrays."""
        return True

    def deliver(self, version: int, arrays: dict[str, Any]) -> None:
        """Nothing beyond the writer's own delivery (the fleet or the in-process source): this backend has no
        samplers of its own."""

    def check(self) -> None:
        """Nothing to check: the copies live in the run's own processes, whose failures surface where they run."""

    def metrics(self, trainer: GRPOTrainer, probe: list[list[int]]) -> dict[str, float]:
        """No figures: there is no push to time and no engine to compare the trainer with."""
        return {}

    def summary(self) -> dict[str, Any]:
        """No fields: there are no engine figures."""
        return {}

    def engine_reads(self) -> list[IdleCounts]:
        """None: the policy runs in the rollout processes, not in an engine."""
        return []

    def close(self) -> None:
        """Nothing to stop: this backend starts no process."""


def publisher(backend: PolicyBackend, deliver: Callable[[int, dict[str, Any]], None] | None, *,
              precision: Precision, checkpoints: CheckpointPublisher | None = None) -> Callable:  # fmt: skip
    """The trainer's ``publish(version, state)``: the float32 master ``state`` cast to the policy's dtype
    (:meth:`rollhub.train.precision.Precision.cast_for_publish`) goes as torch tensors to the backend (an engine
    push) and into ``checkpoints`` (``weights.kind = "checkpoint"``); ``deliver`` (the fleet or the in-process
    source) gets numpy arrays. The built-in transformer is always float32; a ``bfloat16`` policy, which numpy has
    no dtype for, is a Hugging Face one whose ``deliver`` reads only the version, so it gets the tensors as they
    are."""
    as_numpy = precision.policy_dtype != torch.bfloat16

    def publish(version: int, state: dict[str, torch.Tensor]) -> None:
        tensors = precision.cast_for_publish(state)
        backend.deliver(version, tensors)
        if deliver is not None:
            deliver(version, {k: v.numpy() for k, v in tensors.items()} if as_numpy else tensors)
        if checkpoints is not None:
            checkpoints.publish(version, tensors)

    return publish


def sessions_before(resumed: Resumed | None) -> int:
    """How many sessions ran before this one (a resumed session draws a fresh random stream)."""
    return 0 if resumed is None else int(resumed.values.get("sessions", 1))
