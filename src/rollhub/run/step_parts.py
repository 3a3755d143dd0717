"""The parts of a step run, each built from its own config section (and what the assembler,
:mod:`rollhub.run.assemble`, hands it): the environment's probe and recipe, the Ray runtime, the step rollout
managers, the fleet (``fleet.backend``: :class:`~rollhub.rollout.backends.ray.FleetClient` of Ray worker actors,
:class:`~rollhub.rollout.backends.local.LocalFleet` of threads or
:class:`~rollhub.rollout.backends.processes.ProcessFleet` of processes), the PPO learner and the weight publisher.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rollhub.envs.step import EnvSpec, close_env, make_step_env
from rollhub.errors import ConfigError
from rollhub.rollout.protocols import Fleet, RolloutManager
from rollhub.run.config import (
    CheckpointWeightsConfig,
    FleetSection,
    MlpPolicyConfig,
    PPOTrainerConfig,
    RunConfig,
    RunConfigError,
    StepEnvConfig,
    WeightsConfig,
)
from rollhub.run.rundir import Resumed, RunDirectory
from rollhub.run.signals import StopSignals

if TYPE_CHECKING:
    from rollhub.train.ppo import PPOLearner
    from rollhub.weights.base import WeightPublisher


@dataclass(frozen=True)
class EnvShape:
    """What the policy needs to know about the environment: flat observation size and discrete actions."""

    obs_dim: int
    n_actions: int


def env_spec(env: StepEnvConfig) -> EnvSpec:
    """The picklable environment recipe of ``[env]``."""
    return EnvSpec(env.id, dict(env.kwargs), env.task)


def probe_env(config: RunConfig) -> EnvShape:
    """Build one environment here, reset it, take one step and read its sizes (``policy.obs_dim`` /
    ``n_actions`` win), so a mistake in the environment is refused before anything starts.

    Raises:
        RunConfigError: the environment cannot be built, lacks ``reset`` or ``step``, fails or answers in
            another shape on its first reset or step, or does not say how many actions it has.
    """
    try:
        env = make_step_env(env_spec(config.env))
    except ConfigError as exc:
        raise RunConfigError(f"env.id: {exc.message if hasattr(exc, 'message') else exc}") from None
    except Exception as exc:
        raise RunConfigError(
            f"env: building {config.env.id!r} with kwargs {config.env.kwargs} failed ({type(exc).__name__}: {exc}); "
            "fix env.id or env.kwargs"
        ) from None
    try:
        return _first_step(env, config)
    finally:
        try:
            close_env(env)
        except Exception:  # the probe's instance is thrown away; the workers' close() failures are theirs
            pass


def _first_step(env: Any, config: RunConfig) -> EnvShape:
    """The sizes of ``env`` from its first reset, checked by one step of action 0."""
    name = config.env.id
    try:
        obs, _ = env.reset(seed=config.run.seed)
    except Exception as exc:
        raise RunConfigError(
            f"env: reset(seed={config.run.seed}) of {name!r} failed ({type(exc).__name__}: {exc}); "
            "reset(*, seed=None) must return (obs, info)"
        ) from None
    n_actions = config.policy.n_actions or getattr(getattr(env, "action_space", None), "n", None)
    n_actions = n_actions or getattr(env, "action_space_n", None)
    if not n_actions:
        raise RunConfigError(
            f"policy.n_actions: {name!r} has no discrete action_space.n (or action_space_n); set policy.n_actions"
        )
    try:
        _, _, _, _, _ = env.step(np.int64(0))
    except Exception as exc:
        raise RunConfigError(
            f"env: step(0) of {name!r} failed ({type(exc).__name__}: {exc}); step(action) must return "
            "(obs, reward, terminated, truncated, info)"
        ) from None
    return EnvShape(config.policy.obs_dim or int(np.asarray(obs).size), int(n_actions))


WORKER_NICENESS_ENV = "RAY_worker_niceness"
"""Ray's setting of how much its worker processes lower their priority (Ray's default: 15)."""


def start_ray(num_cpus: int, stop: StopSignals) -> bool:
    """Start a local Ray runtime of ``num_cpus`` (``run.ray_num_cpus``) unless one is running; return whether this
    call started it.

    The runtime it starts runs its worker processes at the driver's priority (``RAY_worker_niceness=0``, unless
    the environment sets it). At Ray's default the rollout workers, which every batch the trainer learns from
    waits on, run 15 steps below the trainer and the inference engine, so on a machine whose cores are all busy
    they get a few percent of a core while the others compute and the trainer waits for its batches.
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault(WORKER_NICENESS_ENV, "0")  # read by the processes the runtime starts
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=256 * 2**20,
        log_to_driver=False,
        configure_logging=False,
    )
    stop.install()  # again: the Ray runtime replaced the handlers with its own (a stack dump on SIGTERM)
    return True


def step_managers(fleet: FleetSection, env: EnvSpec, policy: MlpPolicyConfig, shape: EnvShape, *, gamma: float,
                  seed: int) -> Callable[[str], RolloutManager]:  # fmt: skip
    """The picklable ``worker_id -> StepRolloutManager`` of ``[fleet]`` over ``env``, acting with the MLP of
    ``[policy]`` (``gamma``: the trainer's discount; ``seed``: the run's)."""
    from rollhub.inference.mlp_policy import MLPStepPolicy
    from rollhub.rollout.step.manager import StepManagerConfig, step_manager_factory

    manager = StepManagerConfig(
        env=env,
        n_envs=fleet.envs_per_worker,
        env_processes=fleet.env_processes,
        step_threads=fleet.step_threads,
        fragment_length=fleet.fragment_length,
        batch_wait_s=fleet.batch_wait_s,
        gamma=gamma,
        seed=seed,
    )
    return step_manager_factory(
        manager, functools.partial(MLPStepPolicy, shape.obs_dim, shape.n_actions, policy.hidden)
    )


def start_fleet(fleet: FleetSection, managers: Callable[[str], RolloutManager], replay: Any, *,
                max_staleness: int, ray_num_cpus: int) -> Fleet:  # fmt: skip
    """The rollout fleet of ``[fleet]`` running ``managers`` and writing into ``replay`` (a Ray actor handle, or
    with ``fleet.backend = "local"`` or ``"processes"`` a :class:`ReplayBuffer` of this process); its workers drop
    what is more than ``max_staleness`` versions old and share ``ray_num_cpus`` on Ray."""
    from rollhub.rollout.backends.base import FleetConfig
    from rollhub.rollout.worker import RolloutWorkerConfig

    fleet_config = FleetConfig(
        n_workers=fleet.workers,
        worker_num_cpus=min(1.0, ray_num_cpus / fleet.workers),
        worker=RolloutWorkerConfig(
            max_staleness=max_staleness,
            queue_size=fleet.queue_size,
            write_interval_s=fleet.write_interval_s,
            items_per_version=fleet.fragments_per_version,
        ),
    )
    if fleet.backend == "local":
        from rollhub.rollout.backends.local import LocalFleet, LocalWriter

        return LocalFleet(fleet_config, managers, LocalWriter(replay))
    if fleet.backend == "processes":
        from rollhub.rollout.backends.local import LocalWriter
        from rollhub.rollout.backends.processes import ProcessFleet

        return ProcessFleet(fleet_config, managers, LocalWriter(replay))
    from rollhub.rollout.backends.ray import ActorWriter, FleetClient

    return FleetClient.start(fleet_config, managers, ActorWriter(replay))


def make_learner(trainer: PPOTrainerConfig, shape: EnvShape, resumed: Resumed | None, *, hidden: int,
                 seed: int) -> PPOLearner:  # fmt: skip
    """The PPO learner of ``[trainer]`` (``hidden``: the policy's width; ``seed``: the run's), restored from
    ``resumed`` when given."""
    from rollhub.train.ppo import PPOConfig, PPOLearner

    t = trainer
    ppo = PPOConfig(
        hidden=hidden, lr=t.lr, lr_final=t.lr_final, gamma=t.gamma, gae_lambda=t.gae_lambda,
        clip=t.clip, clip_final=t.clip_final, anneal_steps=t.anneal_steps, clip_vf=t.clip_vf, vf_coef=t.vf_coef,
        ent_coef=t.ent_coef, epochs=t.epochs, minibatches=t.minibatches, minibatch_size=t.minibatch_size,
        norm_adv=t.norm_adv, max_grad_norm=t.max_grad_norm, seed=seed, backend=t.backend,
    )  # fmt: skip
    learner = PPOLearner(shape.obs_dim, shape.n_actions, ppo)
    if resumed is not None:
        learner.load_state_dict(resumed.arrays, resumed.values["learner"])
    return learner


def make_publisher(weights: WeightsConfig, rundir: RunDirectory, fleet: Fleet) -> WeightPublisher:
    """The weight publisher of ``[weights]``: the fleet (Ray object store), and a checkpoint directory too."""
    from rollhub.weights import FanOutPublisher
    from rollhub.weights.checkpoint import CheckpointDirectory, CheckpointPublisher

    if isinstance(weights, CheckpointWeightsConfig):
        directory = CheckpointDirectory(rundir.root / weights.dir, keep_last=weights.keep_last)
        return FanOutPublisher(fleet, CheckpointPublisher(directory))
    return fleet
