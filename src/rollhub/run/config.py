"""The configuration of ``rollhub run``: one pydantic-settings model, read from a TOML file.

Precedence, lowest first: the model's defaults, the TOML file, ``ROLLHUB_...`` environment variables (nested
keys joined by ``__``: ``ROLLHUB_TRAINER__LR=3e-4``), then ``--set a.b=value`` overrides. Every plug point is
a discriminated union on ``kind``, so a new kind (a group environment, a GRPO trainer, an HTTP writer) is a new
variant, not a flag: ``env`` (``step``, ``group``, ``external``), ``policy`` (``mlp``, ``transformer``, ``hf``),
``writer`` (``ray_replay``, ``server``, ``in_process``), ``trainer`` (``ppo``, ``grpo``), ``weights`` (``ray``,
``checkpoint``) and each of ``trackers`` (``jsonl``, ``wandb``). The group kinds, ``[curriculum]`` and
``[eval]`` are in :mod:`rollhub.run.config_group`; the Hugging Face policy and ``[inference]`` (vLLM) in
:mod:`rollhub.run.config_llm`; the trainer-only run (``env.kind = "external"``) in
:mod:`rollhub.run.config_external`.

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
from rollhub.run.config_errors import fleet_problems, render_errors
from rollhub.run.config_external import ExternalEnvConfig, external_problems
from rollhub.run.config_group import (
    CurriculumSection,
    EvalSection,
    GroupEnvConfig,
    GRPOTrainerConfig,
    InProcessWriterConfig,
    SamplingSection,
    ServerWriterConfig,
    TransformerPolicyConfig,
    combination_problems,
    kind_problems,
    with_group_defaults,
)
from rollhub.run.config_llm import HFPolicyConfig, InferenceSection, llm_problems
from rollhub.run.toml import false_is_none, none_as_false

ENV_PREFIX = "ROLLHUB_"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSection(_Section):
    """``[run]``: where the run lives and when it stops.

    Attributes:
        name: the label of progress lines, the PNG and the summary.
        dir: the run directory (effective config, metrics, checkpoints, learning curve).
        seed: seeds the learner and the environments.
        max_seconds: stop after this long (this session's wall time).
        max_updates: stop at this policy version (``None``: no limit).
        target_return: stop once the mean return over ``window`` episodes reaches it (``None``: no target).
        window: episodes in the running mean.
        checkpoint_every: save a checkpoint every this many updates (and at the end).
        keep_checkpoints: how many of the newest checkpoints are kept.
        progress: draw a progress line on stderr.
        ray_num_cpus: CPUs of the local Ray runtime started when none is running.
        metrics_port: serve the rollout fleet's Prometheus metrics (``rollhub_fleet_*``) on this port at
            ``/metrics`` while the run lasts (0 or absent: no port).
        metrics_host: the address the metrics port binds (loopback unless you open it).
        metrics_every_s: seconds between readings of the fleet's figures (for the metrics port, and posted to
            the buffer server of a run that writes to one).
    """

    name: str = "run"
    dir: Path = Path("rollhub-runs/run")
    seed: int = 0
    max_seconds: float = Field(600.0, gt=0)
    max_updates: int | None = Field(None, ge=1)
    target_return: float | None = None
    window: int = Field(20, ge=1)
    checkpoint_every: int = Field(10, ge=1)
    keep_checkpoints: int = Field(3, ge=1)
    progress: bool = True
    ray_num_cpus: int = Field(2, ge=1)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_host: str = Field("127.0.0.1", min_length=1)
    metrics_every_s: float = Field(2.0, gt=0, le=3600)


class StepEnvConfig(_Section):
    """``[env]`` with ``kind = "step"``: a gymnasium-API environment.

    Attributes:
        id: ``"package.module:Class"``, a rollhub built-in (``sleep``) or a gymnasium id (``CartPole-v1``).
        kwargs: keyword arguments of the constructor (or of ``gymnasium.make``).
        task: the label episode statistics are grouped by (default: ``id``).
    """

    kind: Literal["step"] = "step"
    id: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    task: str | None = None


class MlpPolicyConfig(_Section):
    """``[policy]`` with ``kind = "mlp"``: separate two-layer tanh MLPs for the action logits and the value
    (discrete actions). ``obs_dim`` and ``n_actions`` are read from the environment when not given."""

    kind: Literal["mlp"] = "mlp"
    hidden: int = Field(64, ge=1)
    obs_dim: int | None = Field(None, ge=1)
    n_actions: int | None = Field(None, ge=2)


class FleetSection(_Section):
    """``[fleet]``: the rollout fleet.

    Attributes:
        backend: ``"ray"``: workers are Ray actors (spread over a cluster's nodes, each in its own process);
            ``"local"`` (step path only): worker threads in the trainer's process, no Ray runtime, with the
            replay buffer and the weights in that process too: the quickest start on one machine, at the price
            of sharing the trainer's GIL (see :mod:`rollhub.rollout.local_fleet`); ``"processes"`` (step path
            only): each worker a process of its own on this machine, no Ray runtime, the replay buffer in the
            trainer's process: every core steps environments (see :mod:`rollhub.rollout.process_fleet`).
        workers: RolloutWorkers (Ray actors, threads with ``backend = "local"``, processes with
            ``"processes"``).
        envs_per_worker: environment instances per worker.
        env_processes: processes a worker's environments are spread over (``None``: 2, double-buffered: one
            half steps while the policy acts for the other). Cheap environments (CartPole) want few processes;
            slow ones (milliseconds per step) one process per environment (``= envs_per_worker``); 0 steps
            them in the worker's own thread (no process, no pipe: fastest for microsecond environments).
        step_threads: with ``env_processes = 0``, split a worker's environments into this many vectors, each
            stepped, and its actions chosen, in a thread of its own while the worker records what they made, so
            only stepping and the forward pass stand between two steps (``envs_per_worker``: one thread per
            environment). For environments that wait (a socket, a sleep, a simulator that releases the GIL), not
            for ones that compute in Python for their whole step (0: off; see
            ``StepManagerConfig.step_threads``).
        fragment_length: steps per fragment.
        batch_wait_s: the longest a ready observation waits for the worker's other environments before the
            forward pass (0: act on what is ready).
        queue_size: fragments a worker holds for its sender thread; when they are full, sampling waits. With
            ``writer.max_queued`` it bounds how far the fleet runs ahead of the trainer: fragments queued more
            than ``writer.max_staleness`` versions ahead are dropped as stale when their turn comes.
        write_interval_s: the shortest time between two writes of a worker's sender: fragments made sooner wait,
            up to this long, and go together, so a fast fleet pays the replay buffer's per-call cost a few dozen
            times a second instead of hundreds (see ``RolloutWorkerConfig.write_interval_s``; nothing waits after
            a quiet spell, with a half-full queue or while a paced worker waits for weights).
        fragments_per_version: pace the fleet to the trainer: each worker makes this many fragments with one
            weight version, then waits for the next (``None``: no pacing). ``writer.batch_size / workers`` makes
            one batch per version while the trainer learns from the previous one: nothing is made that goes
            stale, and the time the fleet waits is the trainer's. ``fragments_per_version * workers`` must be at
            least ``writer.batch_size``. A fragment cut just after new weights arrive holds steps of the
            previous version too, so pacing wants ``writer.max_staleness = 2``.
    """

    backend: Literal["ray", "local", "processes"] = "ray"
    workers: int = Field(2, ge=1)
    envs_per_worker: int = Field(4, ge=1)
    env_processes: int | None = Field(None, ge=0)
    step_threads: int = Field(0, ge=0, strict=True)
    fragment_length: int = Field(64, ge=1)
    batch_wait_s: float = Field(0.0, ge=0)
    queue_size: int = Field(32, ge=1)
    write_interval_s: float = Field(0.02, ge=0)
    fragments_per_version: int | None = Field(None, ge=1)


class RayReplayWriterConfig(_Section):
    """``[writer]`` with ``kind = "ray_replay"``: workers write fragments into a replay-buffer Ray actor that the
    trainer reads batches from.

    Attributes:
        batch_size: fragments per batch (one batch per PPO update).
        max_staleness: the largest ``trainer version - policy_version`` of a step trained on; workers, the
            buffer and the trainer all apply it.
        max_queued: fragments that may wait in the buffer before writers are held back (``None``: no bound).
        storage: ``memory`` or ``sqlite:///path.db``.
    """

    kind: Literal["ray_replay"] = "ray_replay"
    batch_size: int = Field(8, ge=1)
    max_staleness: int = Field(1, ge=0)
    max_queued: int | None = Field(None, ge=1)
    storage: str = "memory"


class PPOTrainerConfig(_Section):
    """``[trainer]`` with ``kind = "ppo"``: the hyperparameters of :class:`rollhub.train.ppo.PPOConfig`.

    Attributes:
        lr, lr_final: Adam learning rate, moved linearly to ``lr_final`` (>= 0; 0 only if you mean it) over
            ``anneal_steps`` trained environment steps, then held there; leave ``lr_final`` out for a constant rate.
        clip, clip_final: the surrogate's clip range, scheduled the same way (leave ``clip_final`` out: constant).
        anneal_steps: the schedules' horizon in trained environment steps (a longer run stays at the finals).
        gamma, gae_lambda: discount and GAE lambda.
        clip_vf: value clipping around the behaviour critic's value (leave out or ``false``: none).
        vf_coef, ent_coef: weights of the value loss and of the entropy bonus.
        epochs: passes over each batch (``writer.batch_size`` fragments).
        minibatches: minibatches per epoch (default 4); or instead
        minibatch_size: samples per minibatch. Set at most one of the two.
        norm_adv: normalise advantages within each minibatch.
        max_grad_norm: gradient-norm clip before each optimizer step.
    """

    kind: Literal["ppo"] = "ppo"
    lr: float = Field(1e-3, gt=0)
    lr_final: float | None = Field(None, ge=0)
    gamma: float = Field(0.99, gt=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    clip: float = Field(0.2, gt=0)
    clip_final: float | None = Field(None, ge=0)
    anneal_steps: int = Field(100_000, ge=1)
    clip_vf: float | None = Field(None, gt=0)
    vf_coef: float = Field(0.5, ge=0)
    ent_coef: float = Field(0.0, ge=0)
    epochs: int = Field(4, ge=1)
    minibatches: int | None = Field(None, ge=1)
    minibatch_size: int | None = Field(None, ge=1)
    norm_adv: bool = True
    max_grad_norm: float = Field(0.5, gt=0)

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
    """``[weights]`` with ``kind = "ray"``: each version reaches the fleet's workers through the Ray object store."""

    kind: Literal["ray"] = "ray"


class CheckpointWeightsConfig(_Section):
    """``[weights]`` with ``kind = "checkpoint"``: as ``ray`` (the fleet's workers load from the object store),
    and every version is also saved as a safetensors checkpoint in ``dir`` (relative to the run directory) for
    processes outside the cluster (:class:`rollhub.weights.checkpoint.CheckpointSubscriber`)."""

    kind: Literal["checkpoint"] = "checkpoint"
    dir: Path = Path("weights")
    keep_last: int = Field(3, ge=1)


class JsonlTrackerConfig(_Section):
    """A tracker writing every metrics row to ``path`` as JSON lines (relative to the run directory)."""

    kind: Literal["jsonl"] = "jsonl"
    path: Path


class WandbTrackerConfig(_Section):
    """A Weights & Biases tracker (``pip install 'rollhub[wandb]'``; honours ``WANDB_MODE=offline``)."""

    kind: Literal["wandb"] = "wandb"
    project: str | None = None
    group: str | None = None


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

    run: RunSection = Field(default_factory=RunSection)
    env: EnvConfig
    policy: PolicyConfig = Field(default_factory=MlpPolicyConfig)
    fleet: FleetSection = Field(default_factory=FleetSection)
    writer: WriterConfig = Field(default_factory=RayReplayWriterConfig)
    trainer: TrainerConfig = Field(default_factory=PPOTrainerConfig)
    weights: WeightsConfig = Field(default_factory=RayWeightsConfig)
    curriculum: CurriculumSection = Field(default_factory=CurriculumSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    inference: InferenceSection = Field(default_factory=InferenceSection)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    trackers: list[TrackerConfig] = Field(default_factory=list)


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
