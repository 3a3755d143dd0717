"""The group (LLM) plug points of ``rollhub run``: a group environment, its lessons, the built-in tiny
transformer, the buffer-server and in-process writers, the GRPO trainer and held-out evaluation.

A group run is ``env.kind = "group"``; its ``policy``, ``writer`` and ``trainer`` tables default to
``transformer``, ``in_process`` and ``grpo`` when they name no kind. :func:`check_combination` refuses the
mixtures that cannot run (a group environment with the PPO trainer, a step environment with the buffer
server, ...), naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_serializer, field_validator, model_validator

from rollhub.run.toml import false_is_none, none_as_false

GROUP_DEFAULTS = {"policy": "transformer", "writer": "in_process", "trainer": "grpo"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EpisodeSection(_Section):
    """``[env.episode]``: the run's environment is a multi-turn one (an
    :class:`~rollhub.envs.episode.base.EpisodeEnv`: ``env.id`` is ``calculator`` or ``"package.module:Class"``,
    ``env.kwargs`` its constructor's arguments), sampled as groups of ``env.group_size`` episodes per task through
    the engine (:class:`~rollhub.envs.episode.runner.EpisodeGroupEnv`); these are its budgets."""

    max_tokens: int = Field(
        1024,
        ge=2,
        description="The whole episode's tokens (its prompt, every turn and every environment reply); at most "
        "`policy.max_len`.",
    )
    turn_max_tokens: int = Field(
        256, ge=1, description="The most tokens one model turn samples (a turn cut here ends its episode, truncated)."
    )
    max_turns: int = Field(8, ge=1, description="The most model turns of an episode.")
    discount: float = Field(
        1.0,
        gt=0,
        le=1,
        description="An episode's score is `sum_t discount**t * r_t` over its turns' rewards (the outcome's added to "
        "the last turn's).",
    )
    tokenizer: str | None = Field(
        None,
        description="Whose chat template renders the conversation (a model directory or hub name; unset: "
        "`policy.model`'s).",
    )

    @model_validator(mode="after")
    def _turn_within_episode(self) -> EpisodeSection:
        if self.turn_max_tokens >= self.max_tokens:
            raise ValueError(
                f"env.episode.turn_max_tokens {self.turn_max_tokens} must be below env.episode.max_tokens "
                f"{self.max_tokens} (the episode's prompt takes some of it); lower it or raise max_tokens"
            )
        return self


class GroupEnvConfig(_Section):
    """``[env]`` with ``kind = "group"``: a :class:`rollhub.envs.group.base.GroupEnv` (prompts in, groups of
    scored completions out)."""

    kind: Literal["group"] = Field("group", description="A group environment: the LLM case, trained by GRPO.")
    id: str = Field(
        description='`"package.module:Class"` of the environment, or a built-in short name (`arithmetic`, `mock`; '
        "with `[env.episode]`: `calculator`)."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of its constructor.")
    lesson: str = Field(
        "main", description="The lesson id of the run's one lesson when `[[curriculum.lessons]]` is not given."
    )
    group_size: int = Field(
        8, ge=2, description="Completions sampled per prompt (one group); with `[env.episode]`, episodes per task."
    )
    episode: EpisodeSection | None = Field(
        None,
        description="Set (`[env.episode]`) when `env.id` names a multi-turn environment (`calculator` or "
        '`"package.module:Class"` of an `EpisodeEnv`): its episode budgets.',
    )


class LessonSection(_Section):
    """One ``[[curriculum.lessons]]`` entry: a lesson of the group environment."""

    id: str = Field(description="Unique lesson id.")
    env_id: str | None = Field(None, description="The lesson's environment (unset: `env.id`).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Constructor arguments, laid over `env.kwargs`.")
    depends_on: list[str] = Field(
        default_factory=list,
        description="Lessons that must be satisfied (smoothed training success >= their `threshold`, or a plateau) "
        "before this one is sampled.",
    )
    threshold: float = Field(0.8, ge=0, le=1, description="The success a dependant requires of this lesson.")
    graduate_threshold: float = Field(
        0.95, ge=0, le=1, description="Evaluation success at which the lesson stops being sampled."
    )


class CurriculumSection(_Section):
    """``[curriculum]``: the lessons of a group run (none: one lesson, ``env.lesson``, of ``env.id``)."""

    lessons: list[LessonSection] = Field(
        default_factory=list,
        description="The lessons (`[[curriculum.lessons]]`, one table each), sampled by the run's one shared "
        "curriculum.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="Rollout turns between the workers' evaluations of every lesson (what graduation is judged on; "
        "0: never).",
    )
    eval_examples: int = Field(32, ge=1, description="Prompts per lesson in such an evaluation.")


class TransformerPolicyConfig(_Section):
    """``[policy]`` with ``kind = "transformer"``: the built-in tiny character-level transformer
    (:class:`rollhub.inference.torch_policy.TinyTransformer` with :class:`CharTokenizer`)."""

    kind: Literal["transformer"] = Field("transformer", description="The built-in tiny transformer.")
    d_model: int = Field(64, ge=1, description="Width (a multiple of `n_heads`).")
    n_layers: int = Field(2, ge=1, description="Transformer blocks.")
    n_heads: int = Field(4, ge=1, description="Attention heads.")
    max_len: int = Field(
        32, ge=2, description="The longest prompt plus completion, in characters (with the start token)."
    )


class ServerWriterConfig(_Section):
    """``[writer]`` with ``kind = "server"``: rollout workers (a Ray fleet of ``fleet.workers``) write groups to
    the buffer server; the trainer pulls leased batches from it (``TrainerClient``)."""

    kind: Literal["server"] = Field("server", description="The buffer server and a Ray fleet.")
    url: str | None = Field(
        None,
        description="A running server to use; unset: a child `rollhub serve` is started on a free loopback port "
        "(and stopped at the end) with `storage` and `max_staleness`.",
    )
    storage: str = Field(
        "sqlite:///buffer.db",
        description="Storage of the started server: `memory` or `sqlite:///PATH` (relative to the run directory; a "
        "fresh run removes an old file, a resumed one keeps it and its queue).",
    )
    max_staleness: int = Field(
        2,
        ge=0,
        description="The largest `trainer version - policy_version` of a group trained on; "
        "the workers' admission and the server apply it (the trainer's source does instead of the server when the "
        "server has no such bound, e.g. AtroposLib); the trainer trains on every group served.",
    )
    lease_s: float = Field(300.0, gt=0, description="A served batch not acknowledged within this time is served again.")


class InProcessWriterConfig(_Section):
    """``[writer]`` with ``kind = "in_process"``: one rollout manager in the trainer's process fills a queue
    the trainer takes batches from (no server, no Ray)."""

    kind: Literal["in_process"] = Field("in_process", description="One process, no server and no Ray.")
    max_staleness: int = Field(
        2,
        ge=0,
        description="The in-process queue's staleness bound (groups here are sampled with the newest weights and "
        "are at most one version old unless a sampling turn makes more than a batch).",
    )


class GRPOTrainerConfig(_Section):
    """``[trainer]`` with ``kind = "grpo"``: the hyperparameters of :class:`rollhub.train.grpo.GRPOConfig`."""

    kind: Literal["grpo"] = Field("grpo", description="GRPO over groups.")
    groups_per_batch: int = Field(
        16,
        ge=1,
        description="Prompts (groups) per batch; a batch is `groups_per_batch * env.group_size` sequences, one "
        "optimizer update.",
    )
    lr: float = Field(3e-3, gt=0, description="Adam learning rate at the start.")
    lr_final: float | None = Field(
        None, gt=0, description="The learning rate reached along a cosine over `anneal_steps` (unset: constant)."
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of an entropy bonus on completion tokens at the start (keeps small groups from "
        "collapsing onto one answer before the reward has told them apart).",
    )
    entropy_coef_final: float | None = Field(
        None, ge=0, description="The entropy bonus reached along a cosine over `anneal_steps` (unset: constant)."
    )
    anneal_steps: int = Field(
        0,
        ge=0,
        description="Updates over which `lr` and `entropy_coef` fall along a cosine to their final values (0: "
        "constant).",
    )
    clip_eps: float = Field(0.2, gt=0, description="The importance ratio is clipped to `[1 - clip_eps, 1 + clip_eps]`.")
    adv_eps: float = Field(1e-4, gt=0, description="Added to the group standard deviation before dividing.")
    epochs: int = Field(1, ge=1, description="Optimizer passes over each batch.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip before each optimizer step.")
    correction: str = Field(
        "tis",
        description="The off-policy correction preset (`rollhub.train.offpolicy.PRESETS`): `tis`, `decoupled`, "
        "`icepop`, `seq_tis`, `seq_mask`, `geo_mask`, `ppo`, `none`.",
    )
    correction_cap: float | None = Field(
        None, gt=0, description="Replaces the preset's truncation (`tis`, `decoupled`, `seq_tis`; unset: the preset's)."
    )
    correction_bounds: tuple[float, float] | None = Field(
        None,
        description="`[low, high]`, replaces the preset's mask bounds (`icepop`, `seq_mask`, `geo_mask`; unset: the "
        "preset's).",
    )
    dual_clip: float | None = Field(
        3.0,
        gt=1,
        description="Dual-clip PPO: a negative advantage's term is bounded at `dual_clip * A`; must exceed "
        "`1 + clip_eps`; `false`: off. (This key was `ratio_cap`.)",
    )
    logprob_chunk: int | None = Field(
        1 << 25,
        ge=1,
        description="Logits computed per block in the loss (positions x vocabulary), so a large vocabulary never "
        "holds the whole `[sequences, time, vocab]` tensor; `false`: all at once.",
    )
    mismatch_warn: float | None = Field(
        0.05,
        gt=0,
        description="Log a warning when a step's `mismatch_abs` (mean `|logp_trainer - logp_behaviour|` over data "
        "sampled by the trainer's current weights) exceeds this; `false`: never warn.",
    )
    distill_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of a KL term toward the teacher's top-k distribution that groups send in "
        "`distill_token_ids` / `distill_logprobs` (AtroposLib's on-policy distillation fields; "
        "`rollhub.train.distill`); 0: off, the fields are not read.",
    )

    _off = field_validator("dual_clip", "mismatch_warn", "logprob_chunk", mode="before")(
        false_is_none("true is not a setting; give a number, or false to turn it off")
    )
    _off_as_false = field_serializer("dual_clip", "mismatch_warn", "logprob_chunk", when_used="json")(none_as_false)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "ratio_cap" in data:
            raise ValueError(
                "trainer.ratio_cap is now trainer.dual_clip (it bounds negative-advantage terms: dual-clip PPO); "
                "truncated importance sampling is trainer.correction = 'tis' with trainer.correction_cap"
            )
        return data

    @field_validator("correction")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        from rollhub.train.offpolicy import PRESETS

        if value not in PRESETS:
            raise ValueError(f"{value!r} is not a correction preset; use one of {', '.join(sorted(PRESETS))}")
        return value

    @model_validator(mode="after")
    def _dual_clip_above_clip(self) -> GRPOTrainerConfig:
        if self.dual_clip is not None and not self.dual_clip > 1 + self.clip_eps:
            raise ValueError(
                f"trainer.dual_clip {self.dual_clip} must exceed 1 + trainer.clip_eps = {1 + self.clip_eps}; "
                "raise it, or false for no dual clip"
            )
        if self.correction_bounds is not None and not 0 <= self.correction_bounds[0] < self.correction_bounds[1]:
            raise ValueError(f"trainer.correction_bounds {list(self.correction_bounds)} must be [low, high], "
                             "0 <= low < high")  # fmt: skip
        return self


class SamplingSection(_Section):
    """``[sampling]``: the settings every training sample of a group run is drawn with, sent explicitly with every
    request (an engine never fills one in from the model's ``generation_config.json``). A key left out keeps the
    environment's own value; evaluation stays greedy. The trainer computes its log-probs under the same
    distribution (temperature and truncation), from what each group records in ``generation_params``."""

    temperature: float | None = Field(None, gt=0, description="Softmax temperature.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus mass kept (1: off).")
    top_k: int | None = Field(None, ge=-1, description="Most likely tokens kept (0: off).")
    min_p: float | None = Field(
        None, ge=0, le=1, description="Tokens below this share of the top probability are dropped (0: off)."
    )
    repetition_penalty: float | None = Field(
        None,
        description="Sent as 1; another value is refused, since the trainer does not reproduce history-dependent "
        "penalties (its log-probs would then not be of the distribution that sampled the tokens).",
    )
    presence_penalty: float | None = Field(None, description="Sent as 0; another value is refused, as above.")
    frequency_penalty: float | None = Field(None, description="Sent as 0; another value is refused, as above.")
    max_tokens: int | None = Field(None, ge=1, description="Completion tokens per sample (unset: the environment's).")
    stop: list[str] | None = Field(None, description="Strings that end a completion.")

    @field_validator("repetition_penalty", "presence_penalty", "frequency_penalty")
    @classmethod
    def _neutral(cls, value: float | None, info: ValidationInfo) -> float | None:
        from rollhub.models.sampling import NEUTRAL_PENALTIES

        neutral = NEUTRAL_PENALTIES[info.field_name]
        if value is not None and value != neutral:
            raise ValueError(
                f"{value} is refused: the trainer does not reproduce history-dependent penalties, so its log-probs "
                f"would not be of the distribution that sampled the tokens; leave it out or set {neutral}"
            )
        return value

    def overrides(self) -> dict[str, Any]:
        """The keys given, as :class:`rollhub.inference.base.SamplingParams` fields."""
        out = {k: v for k, v in self.model_dump(exclude_none=True).items()}
        if "stop" in out:
            out["stop"] = tuple(out["stop"])
        return out


class EvalSection(_Section):
    """``[eval]``: held-out evaluation of a group run, by the trainer's process, greedy, ``mode="eval"``."""

    every: int = Field(25, ge=1, description="Trainer updates between evaluations (and at the start and the end).")
    n_examples: int | None = Field(
        None, ge=1, description='Prompts per lesson (unset: every prompt the environment has for `mode="eval"`).'
    )
    target_accuracy: float | None = Field(
        None, gt=0, description="Stop once the held-out accuracy reaches it (unset: no target)."
    )


def storage_path(storage: str, run_dir: Path) -> str:
    """``sqlite:///PATH`` with a relative ``PATH`` anchored at the run directory; other storages as given."""
    prefix = "sqlite:///"
    if storage.startswith(prefix) and not Path(storage[len(prefix) :]).is_absolute():
        return prefix + str(run_dir / storage[len(prefix) :])
    return storage
