"""The configuration of ``rollhub run``: one pydantic-settings model, read from a TOML file.

Precedence, lowest first: the model's defaults, the TOML file, ``ROLLHUB_...`` environment variables (nested
keys joined by ``__``: ``ROLLHUB_TRAINER__LR=3e-4``), then ``--set a.b=value`` overrides. Every plug point is
a discriminated union on ``kind``, so a new kind (a group environment, a GRPO trainer, an HTTP writer) is a new
variant, not a flag: ``env`` (``step``, ``group``, ``external``), ``policy`` (``mlp``, ``transformer``, ``hf``),
``writer`` (``ray_replay``, ``server``, ``in_process``), ``trainer`` (``ppo``, ``grpo``), ``weights`` (``ray``,
``checkpoint``) and each of ``trackers`` (``jsonl``, ``wandb``). The group kinds, ``[curriculum]`` and
``[eval]`` are in :mod:`rollhub.run.config_group`; the Hugging Face policy and ``[inference]`` (vLLM) in
:mod:`rollhub.run.config_llm`; the trainer-only run (``env.kind = "external"``) in
:mod:`rollhub.run.config_external`; the checks across sections in :mod:`rollhub.run.config_checks`.

Errors come out as :class:`RunConfigError`: one line per problem, naming the key path and what to do.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
)
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from rollhub.errors import ConfigError
from rollhub.run.config_checks import (
    combination_problems,
    external_problems,
    fleet_problems,
    kind_problems,
    render_errors,
    with_group_defaults,
)
from rollhub.run.config_external import ExternalEnvConfig
from rollhub.run.config_group import (
    CurriculumSection,
    EvalSection,
    GroupEnvConfig,
    GRPOTrainerConfig,
    InProcessWriterConfig,
    SamplingSection,
    ServerWriterConfig,
    TransformerPolicyConfig,
)
from rollhub.run.config_llm import HFPolicyConfig, InferenceSection, llm_problems
from rollhub.run.toml import false_is_none, none_as_false

ENV_PREFIX = "ROLLHUB_"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSection(_Section):
    """``[run]``: where the run lives and when it stops."""

    name: str = Field("run", description="The run's label: on the progress line, the PNG's name and the summary.")
    dir: Path = Field(
        Path("rollhub-runs/run"),
        description="The run directory: effective config, metrics, checkpoints, learning curve and summary.",
    )
    seed: int = Field(0, description="Seeds the learner and the environments.")
    max_seconds: float = Field(600.0, gt=0, description="Stop after this long (this session's wall time).")
    max_updates: int | None = Field(None, ge=1, description="Stop at this policy version (unset: no limit).")
    target_return: float | None = Field(
        None,
        description="Step runs: stop once the mean return over `window` episodes reaches it (unset: no target). "
        "A group run has no episodes: use `eval.target_accuracy`.",
    )
    window: int = Field(20, ge=1, description="Episodes in the running mean (step runs).")
    checkpoint_every: int = Field(10, ge=1, description="Save a checkpoint every this many updates (and at the end).")
    keep_checkpoints: int = Field(3, ge=1, description="How many of the newest checkpoints are kept.")
    progress: bool = Field(True, description="Draw a live progress line on stderr.")
    ray_num_cpus: int = Field(
        2,
        ge=1,
        description='CPUs of the local Ray runtime started when none is running; unused with `fleet.backend = "local"` '
        'or `"processes"`.',
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve the rollout fleet's Prometheus metrics (`rollhub_fleet_*`) on this port at `/metrics` "
        "while the run lasts (unset or 0: no port). A port that is already taken stops the run before it trains.",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="The address the metrics port binds; the port asks for no key, so keep it on loopback or a "
        "trusted network.",
    )
    metrics_every_s: float = Field(
        2.0,
        gt=0,
        le=3600,
        description="Seconds between readings of the fleet's figures (for the metrics port, and posted to the buffer "
        "server of a group run that writes to one).",
    )


class StepEnvConfig(_Section):
    """``[env]`` with ``kind = "step"``: a gymnasium-API environment."""

    kind: Literal["step"] = Field("step", description="A step environment.")
    id: str = Field(
        description='`"package.module:Class"`, a rollhub built-in (`sleep`) or a gymnasium id (`CartPole-v1`).'
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the constructor (or of `gymnasium.make`)."
    )
    task: str | None = Field(None, description="The label episode statistics are grouped by (unset: `id`).")


class MlpPolicyConfig(_Section):
    """``[policy]`` with ``kind = "mlp"``: separate two-layer tanh MLPs for the action logits and the value
    (discrete actions)."""

    kind: Literal["mlp"] = Field("mlp", description="The MLP actor-critic of a step run.")
    hidden: int = Field(64, ge=1, description="Width of each hidden layer.")
    obs_dim: int | None = Field(None, ge=1, description="Observation size (unset: read from the environment).")
    n_actions: int | None = Field(None, ge=2, description="Discrete actions (unset: read from the environment).")


class FleetSection(_Section):
    """``[fleet]``: the rollout fleet. Group runs use its ``workers`` (with ``writer.kind = "server"``)."""

    backend: Literal["ray", "local", "processes"] = Field(
        "ray",
        description='`"ray"`: workers are Ray actors (spread over a cluster\'s nodes, each in its own process) on a '
        'Ray runtime, started when none runs. `"local"` (step runs only): worker threads in the trainer\'s process, '
        "with the replay buffer and the weights there too and no Ray at all: the quickest start on one machine, at "
        'the price of sharing the trainer\'s GIL. `"processes"` (step runs only): a process of its own per worker '
        "on this machine, the replay buffer in the trainer's process, no Ray at all: every core steps environments.",
    )
    workers: int = Field(
        2, ge=1, description='RolloutWorkers (Ray actors, threads with `"local"`, processes with `"processes"`).'
    )
    envs_per_worker: int = Field(4, ge=1, description="Environment instances per worker.")
    env_processes: int | None = Field(
        None,
        ge=0,
        description="Processes a worker's environments are spread over (unset: 2, double-buffered: one half steps "
        "while the policy acts for the other). Cheap environments (CartPole) want few processes; slow ones "
        "(milliseconds per step) one process per environment (`= envs_per_worker`); 0 steps them in the worker "
        "itself (no process, no pipe: fastest for microsecond environments).",
    )
    step_threads: int = Field(
        0,
        ge=0,
        strict=True,
        description="With `env_processes = 0`, split a worker's environments into this many vectors, each stepped, "
        "and its actions chosen, in a thread of its own while the worker records what they made (`envs_per_worker`: "
        "a thread per environment). For environments that wait (a socket, a sleep, a simulator that releases the "
        "GIL), not for ones that compute in Python for their whole step. 0: off.",
    )
    fragment_length: int = Field(64, ge=1, description="Steps per fragment.")
    batch_wait_s: float = Field(
        0.0,
        ge=0,
        description="The longest a ready observation waits for the worker's other environments before the forward "
        "pass (0: act on what is ready).",
    )
    queue_size: int = Field(
        32,
        ge=1,
        description="Fragments a worker holds for its sender thread; when they are full, sampling waits. With "
        "`writer.max_queued` it bounds how far the fleet runs ahead of the trainer: fragments queued more than "
        "`writer.max_staleness` versions ahead are dropped as stale when their turn comes.",
    )
    write_interval_s: float = Field(
        0.02,
        ge=0,
        description="The shortest time between two writes of a worker's sender: fragments made sooner wait, up to "
        "this long, and go together, so a fast fleet pays the replay buffer's per-call cost a few dozen times a "
        "second instead of hundreds. Nothing waits after a quiet spell, with a half-full queue or while a paced "
        "worker waits for weights. 0: every write at once.",
    )
    fragments_per_version: int | None = Field(
        None,
        ge=1,
        description="Pace the fleet to the trainer: each worker makes this many fragments with one weight version, "
        "then waits for the next (unset: no pacing). `writer.batch_size / workers` makes one batch per version while "
        "the trainer learns from the previous one: nothing is made that goes stale. `fragments_per_version * "
        "workers` must be at least `writer.batch_size`. A fragment cut just after new weights arrive holds steps of "
        "the previous version too, so pacing wants `writer.max_staleness = 2`.",
    )
    admission: bool = Field(
        True,
        description='Group runs with `writer.kind = "server"`: a worker\'s training turn makes only the groups that, '
        "with those queued at the server and its own unsent ones counted for every worker, fit in "
        "`writer.max_staleness` trainer batches (a smaller turn when a whole one does not fit; it waits while none "
        "does), so everything it samples is served before it grows too stale and the server's staleness drop stays a "
        "guard. False: sample ahead freely (the server drops what went stale).",
    )


class RayReplayWriterConfig(_Section):
    """``[writer]`` with ``kind = "ray_replay"``: workers write fragments into a replay buffer that the trainer reads
    batches from (a Ray actor, or with ``fleet.backend = "local"`` or ``"processes"`` an object in the trainer's
    process)."""

    kind: Literal["ray_replay"] = Field("ray_replay", description="The replay buffer of a step run.")
    batch_size: int = Field(8, ge=1, description="Fragments per batch (one batch per PPO update).")
    max_staleness: int = Field(
        1,
        ge=0,
        description="The largest `trainer version - policy_version` of a step trained on, in policy versions; "
        "the workers' admission and the buffer apply it; the trainer trains on every fragment served.",
    )
    max_queued: int | None = Field(
        None,
        ge=1,
        description="Fragments that may wait in the buffer before writers are held back (unset: no bound; at least "
        "`batch_size`).",
    )
    storage: str = Field("memory", description="`memory` or `sqlite:///path.db`.")


class PPOTrainerConfig(_Section):
    """``[trainer]`` with ``kind = "ppo"``: the hyperparameters of :class:`rollhub.train.ppo.PPOConfig`."""

    kind: Literal["ppo"] = Field("ppo", description="PPO over fragments, for step runs.")
    lr: float = Field(1e-3, gt=0, description="Adam learning rate at the start.")
    lr_final: float | None = Field(
        None,
        ge=0,
        description="The learning rate reached linearly over `anneal_steps` and held after (0 only if you mean it; "
        "unset: constant `lr`).",
    )
    gamma: float = Field(0.99, gt=0, le=1, description="Discount.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    clip: float = Field(0.2, gt=0, description="The surrogate's clip range at the start.")
    clip_final: float | None = Field(
        None, ge=0, description="The clip range reached over `anneal_steps`, as for `lr_final` (unset: constant)."
    )
    anneal_steps: int = Field(
        100_000,
        ge=1,
        description="The schedules' horizon in trained environment steps: `lr` and `clip` move linearly to their "
        "finals over them and stay there.",
    )
    clip_vf: float | None = Field(
        None,
        gt=0,
        description="Value clipping around the behaviour critic's value (unset or `false`: value loss unclipped).",
    )
    vf_coef: float = Field(0.5, ge=0, description="Weight of the value loss.")
    ent_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    epochs: int = Field(4, ge=1, description="Passes over each batch (`writer.batch_size` fragments).")
    minibatches: int | None = Field(
        None, ge=1, description="Minibatches per epoch (4 when neither this nor `minibatch_size` is set)."
    )
    minibatch_size: int | None = Field(
        None, ge=1, description="Samples per minibatch, instead of `minibatches`; set at most one of the two."
    )
    norm_adv: bool = Field(True, description="Normalise advantages within each minibatch.")
    max_grad_norm: float = Field(0.5, gt=0, description="Gradient-norm clip before each optimizer step.")
    backend: Literal["autograd", "numpy"] = Field(
        "autograd",
        description="How each minibatch's gradients are taken: `autograd` (torch's `backward()` on the loss) or "
        "`numpy` (the same loss differentiated by hand in numpy, tested equal to autograd; faster on small MLPs).",
    )

    _off = field_validator("clip_vf", mode="before")(
        false_is_none("true is not a setting; give a number, or false for no value clipping")
    )
    _off_as_false = field_serializer("clip_vf", when_used="json")(none_as_false)

    @field_validator("minibatch_size")
    @classmethod
    def _one_minibatch_setting(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("minibatches") is not None:
            raise ValueError(
                "trainer.minibatches is set too; set one of minibatches (per epoch) and minibatch_size (samples)"
            )
        return value


class RayWeightsConfig(_Section):
    """``[weights]`` with ``kind = "ray"``: each version reaches the fleet's workers through the Ray object store (on
    the local fleet they share one read-only copy)."""

    kind: Literal["ray"] = Field("ray", description="Weights through the Ray object store.")


class CheckpointWeightsConfig(_Section):
    """``[weights]`` with ``kind = "checkpoint"``: as ``ray`` (the fleet's workers load from the object store),
    and every version is also saved as a safetensors checkpoint for processes outside the cluster
    (:class:`rollhub.weights.checkpoint.CheckpointSubscriber`)."""

    kind: Literal["checkpoint"] = Field("checkpoint", description="As `ray`, and every version saved as safetensors.")
    dir: Path = Field(Path("weights"), description="Where the checkpoints go, relative to the run directory.")
    keep_last: int = Field(3, ge=1, description="How many of the newest versions are kept.")


class JsonlTrackerConfig(_Section):
    """A ``[[trackers]]`` entry writing every metrics row as JSON lines."""

    kind: Literal["jsonl"] = Field("jsonl", description="A JSON-lines file.")
    path: Path = Field(description="The file, relative to the run directory.")


class WandbTrackerConfig(_Section):
    """A ``[[trackers]]`` entry for Weights & Biases (``pip install 'rollhub[wandb]'``; honours
    ``WANDB_MODE=offline``)."""

    kind: Literal["wandb"] = Field("wandb", description="A Weights & Biases run.")
    project: str | None = Field(None, description="The W&B project.")
    group: str | None = Field(None, description="The W&B group.")


def _kind(model: type[BaseModel]) -> str:
    return model.model_fields["kind"].default


def plug(*models: type[BaseModel]) -> Any:
    """A discriminated union on ``kind`` over ``models``; a table without ``kind`` is the first model."""
    default = _kind(models[0])

    def tag(value: Any) -> str:
        return value.get("kind", default) if isinstance(value, dict) else getattr(value, "kind", default)

    variants = tuple(Annotated[m, Tag(_kind(m))] for m in models)
    return Annotated[Union[variants], Discriminator(tag)]  # noqa: UP007


EnvConfig = plug(StepEnvConfig, GroupEnvConfig, ExternalEnvConfig)
PolicyConfig = plug(MlpPolicyConfig, TransformerPolicyConfig, HFPolicyConfig)
WriterConfig = plug(RayReplayWriterConfig, ServerWriterConfig, InProcessWriterConfig)
TrainerConfig = plug(PPOTrainerConfig, GRPOTrainerConfig)
WeightsConfig = plug(RayWeightsConfig, CheckpointWeightsConfig)
TrackerConfig = plug(JsonlTrackerConfig, WandbTrackerConfig)


class RunConfig(BaseSettings):
    """The whole of a run: every section above. Build it with :func:`load_config`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid")

    run: RunSection = Field(default_factory=RunSection, description="Where the run lives and when it stops.")
    env: EnvConfig = Field(description="The environment: `step` (gymnasium API) or `group` (prompts and groups).")
    policy: PolicyConfig = Field(
        default_factory=MlpPolicyConfig, description="The policy: `mlp`, `transformer` or `hf`."
    )
    fleet: FleetSection = Field(default_factory=FleetSection, description="The rollout fleet.")
    writer: WriterConfig = Field(
        default_factory=RayReplayWriterConfig,
        description="Where rollouts go and the trainer reads them: `ray_replay`, `server` or `in_process`.",
    )
    trainer: TrainerConfig = Field(default_factory=PPOTrainerConfig, description="The trainer: `ppo` or `grpo`.")
    weights: WeightsConfig = Field(
        default_factory=RayWeightsConfig, description="How weights reach the fleet: `ray` or `checkpoint`."
    )
    curriculum: CurriculumSection = Field(default_factory=CurriculumSection, description="The lessons of a group run.")
    eval: EvalSection = Field(default_factory=EvalSection, description="Held-out evaluation of a group run.")
    inference: InferenceSection = Field(
        default_factory=InferenceSection, description='The vLLM engines of a `policy.kind = "hf"` run.'
    )
    sampling: SamplingSection = Field(
        default_factory=SamplingSection, description="The settings every training sample of a group run is drawn with."
    )
    trackers: list[TrackerConfig] = Field(
        default_factory=list, description="Zero or more trackers: `jsonl` and `wandb`."
    )


class RunConfigError(ConfigError):
    """A configuration that cannot run; the message has one line per problem, each naming its key path."""


def parse_set(assignment: str) -> tuple[list[str], Any]:
    """``"a.b=value"`` -> ``(["a", "b"], value)``; the value is read as a TOML value, else kept as a string."""
    key, sep, raw = assignment.partition("=")
    path = [part.strip() for part in key.split(".")]
    if not sep or not all(path):
        raise RunConfigError(f"--set {assignment!r}: write it as KEY.PATH=VALUE, e.g. --set trainer.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _sets_to_dict(sets: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for assignment in sets:
        path, value = parse_set(assignment)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RunConfigError(f"--set {assignment!r}: {part!r} was already given a value, not a table")
        node[path[-1]] = value
    return out


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict; a missing or malformed file is a :class:`RunConfigError`."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RunConfigError(f"config file {path} does not exist; give the path of a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise RunConfigError(f"config file {path} is not valid TOML: {exc}; fix the file") from None


def load_config(data: dict[str, Any], sets: list[str] | None = None, source: str = "the config") -> RunConfig:
    """The effective config: ``data`` (a parsed file), under ``ROLLHUB_*`` variables, under ``sets``.

    Raises:
        RunConfigError: every problem, one line each, naming the key path and what to do.
    """
    env_values = EnvSettingsSource(RunConfig, env_prefix=ENV_PREFIX, env_nested_delimiter="__")()
    merged = with_group_defaults(_merge(_merge(data, env_values), _sets_to_dict(sets or [])))
    _refuse(kind_problems(merged), source)
    try:
        config = RunConfig(**merged)
    except ValidationError as exc:
        raise RunConfigError(render_errors(exc, source, RunConfig)) from None
    problems = combination_problems(config) + llm_problems(config) + fleet_problems(config)
    _refuse(problems + external_problems(config), source)
    return config


def _refuse(problems: list[str], source: str) -> None:
    if problems:
        raise RunConfigError(
            "\n".join([f"{source} is not a valid run config ({len(problems)} problem(s)):", *problems])
        )
