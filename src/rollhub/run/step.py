"""The step path of ``rollhub run``: build the object graph from a :class:`RunConfig` and run PPO on it.

The graph: a replay-buffer Ray actor (the ``writer``), a :class:`rollhub.rollout.fleet.RolloutFleet` of
RolloutWorkers, each a StepRolloutManager over environment processes (``env``, ``policy``, ``fleet``), the
:class:`rollhub.train.ppo.PPOLearner` in this process (``trainer``), the weight publisher (``weights``) and a
:class:`rollhub.run.monitor.RunMonitor` (metrics, trackers, progress, checkpoints). Everything that can be
checked without starting anything (the environment builds and says its sizes) is checked first.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollhub.demos.stopping import StopSignals
from rollhub.envs.step import EnvSpec, make_step_env
from rollhub.errors import ConfigError
from rollhub.run.config import CheckpointWeightsConfig, RunConfig, RunConfigError
from rollhub.run.rundir import Resumed, RunDirectory


@dataclass(frozen=True)
class EnvShape:
    """What the policy needs to know about the environment: flat observation size and discrete actions."""

    obs_dim: int
    n_actions: int


def env_spec(config: RunConfig) -> EnvSpec:
    """The picklable environment recipe of ``[env]``."""
    return EnvSpec(config.env.id, dict(config.env.kwargs), config.env.task)


def probe_env(config: RunConfig) -> EnvShape:
    """Build one environment here, reset it and read its sizes (``policy.obs_dim`` / ``n_actions`` win).

    Raises:
        RunConfigError: the environment cannot be built or reset, or does not say how many actions it has.
    """
    try:
        env = make_step_env(env_spec(config))
    except ConfigError as exc:
        raise RunConfigError(f"env.id: {exc.message if hasattr(exc, 'message') else exc}") from None
    except Exception as exc:
        raise RunConfigError(
            f"env: building {config.env.id!r} with kwargs {config.env.kwargs} failed ({type(exc).__name__}: {exc}); "
            "fix env.id or env.kwargs"
        ) from None
    try:
        obs, _ = env.reset(seed=config.run.seed)
        n_actions = config.policy.n_actions or getattr(getattr(env, "action_space", None), "n", None)
        n_actions = n_actions or getattr(env, "action_space_n", None)
    except Exception as exc:
        raise RunConfigError(f"env: reset() of {config.env.id!r} failed ({type(exc).__name__}: {exc})") from None
    finally:
        env.close()
    if not n_actions:
        raise RunConfigError(
            f"policy.n_actions: {config.env.id!r} has no discrete action_space.n (or action_space_n); "
            "set policy.n_actions"
        )
    return EnvShape(config.policy.obs_dim or int(np.asarray(obs).size), int(n_actions))


def start_ray(config: RunConfig, stop: StopSignals) -> bool:
    """Start a local Ray runtime unless one is running; return whether this call started it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(
        num_cpus=config.run.ray_num_cpus,
        include_dashboard=False,
        object_store_memory=256 * 2**20,
        log_to_driver=False,
        configure_logging=False,
    )
    stop.install()  # again: the Ray runtime replaced the handlers with its own (a stack dump on SIGTERM)
    return True


def start_fleet(config: RunConfig, shape: EnvShape, replay: Any) -> Any:
    """The rollout fleet of ``[fleet]`` writing into ``replay``."""
    from rollhub.rollout.fleet import FleetClient, FleetConfig
    from rollhub.rollout.step_manager import StepManagerConfig, step_manager_factory
    from rollhub.rollout.worker import RolloutWorkerConfig
    from rollhub.rollout.writers import ActorWriter
    from rollhub.train.ppo import TorchStepPolicy

    fleet = config.fleet
    manager = StepManagerConfig(
        env=env_spec(config),
        n_envs=fleet.envs_per_worker,
        env_processes=fleet.env_processes,
        fragment_length=fleet.fragment_length,
        batch_wait_s=fleet.batch_wait_s,
        gamma=config.trainer.gamma,
        seed=config.run.seed,
    )
    policy = functools.partial(TorchStepPolicy, shape.obs_dim, shape.n_actions, config.policy.hidden)
    fleet_config = FleetConfig(
        n_workers=fleet.workers,
        worker_num_cpus=min(1.0, config.run.ray_num_cpus / fleet.workers),
        worker=RolloutWorkerConfig(
            max_staleness=config.writer.max_staleness,
            queue_size=fleet.queue_size,
            items_per_version=fleet.fragments_per_version,
        ),
    )
    return FleetClient.start(fleet_config, step_manager_factory(manager, policy), ActorWriter(replay))


def make_learner(config: RunConfig, shape: EnvShape, resumed: Resumed | None) -> Any:
    """The PPO learner of ``[trainer]``, restored from ``resumed`` when given."""
    from rollhub.train.ppo import PPOConfig, PPOLearner

    t = config.trainer
    ppo = PPOConfig(
        hidden=config.policy.hidden, lr=t.lr, lr_final=t.lr_final, gamma=t.gamma, gae_lambda=t.gae_lambda,
        clip=t.clip, clip_final=t.clip_final, anneal_steps=t.anneal_steps, clip_vf=t.clip_vf, vf_coef=t.vf_coef,
        ent_coef=t.ent_coef, epochs=t.epochs, minibatches=t.minibatches, minibatch_size=t.minibatch_size,
        norm_adv=t.norm_adv, max_grad_norm=t.max_grad_norm, seed=config.run.seed,
    )  # fmt: skip
    learner = PPOLearner(shape.obs_dim, shape.n_actions, ppo)
    if resumed is not None:
        learner.load_state_dict(resumed.arrays, resumed.values["learner"])
    return learner


def make_publisher(config: RunConfig, rundir: RunDirectory, fleet: Any) -> Any:
    """The weight publisher of ``[weights]``: the fleet (Ray object store), and a checkpoint directory too."""
    from rollhub.weights import FanOutPublisher
    from rollhub.weights.checkpoint import CheckpointDirectory, CheckpointPublisher

    weights = config.weights
    if isinstance(weights, CheckpointWeightsConfig):
        directory = CheckpointDirectory(rundir.root / weights.dir, keep_last=weights.keep_last)
        return FanOutPublisher(fleet, CheckpointPublisher(directory))
    return fleet


def run_step_path(
    config: RunConfig,
    rundir: RunDirectory,
    resumed: Resumed | None,
    stop: StopSignals,
    note: Callable[[str], None],
    shape: EnvShape | None = None,
) -> dict[str, Any]:
    """Build the graph, train until a stop condition, write the summary and the PNG; return the summary.

    ``shape`` is the environment's sizes when the caller has probed it already (:func:`probe_env`).
    """
    shape = shape or probe_env(config)
    note(f"{config.run.name}: loading Ray and torch...")
    import ray
    import torch

    from rollhub.rollout.replay import start_replay_buffer

    torch.set_num_threads(1)
    started = time.perf_counter()
    # The learner is built while Ray starts (mostly waiting for its processes): the first optimizer pulls in
    # about a second of torch's lazy imports that would otherwise compete with the fleet's start for the CPU.
    pool = ThreadPoolExecutor(1, thread_name_prefix="learner")
    learner = pool.submit(make_learner, config, shape, resumed)
    pool.shutdown(wait=False)
    note(f"{config.run.name}: starting Ray ({config.run.ray_num_cpus} CPUs)...")
    own_ray = start_ray(config, stop)
    fleet = None
    try:
        w = config.writer  # a resumed run's version reaches the buffer with the trainer's first publish
        replay = start_replay_buffer(w.batch_size, w.max_staleness, w.max_queued, w.storage)
        fleet_cfg = config.fleet
        note(f"{config.run.name}: starting {fleet_cfg.workers} rollout workers x {fleet_cfg.envs_per_worker} envs...")
        fleet = start_fleet(config, shape, replay)
        return _train(config, rundir, resumed, stop, learner.result(), replay, fleet, started)
    finally:
        if fleet is not None:
            fleet.stop()
        if own_ray:
            ray.shutdown()


def _train(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals, learner: Any,
           replay: Any, fleet: Any, started: float) -> dict[str, Any]:  # fmt: skip
    from rollhub.experience import StalenessPolicy
    from rollhub.run.monitor import RunMonitor
    from rollhub.run.report import summarize
    from rollhub.train.ppo import PPOState, train_ppo
    from rollhub.train.sources import RayReplaySource

    state = PPOState(**resumed.values["state"]) if resumed is not None else PPOState()
    monitor = RunMonitor(config, rundir, learner, fleet.statistics(), stop, resumed, started=started)
    reason = "not started"
    try:
        reason = train_ppo(
            learner,
            RayReplaySource(replay, fleet),
            make_publisher(config, rundir, fleet),
            StalenessPolicy(config.writer.max_staleness),
            state,
            stop_reason=monitor.stop_reason,
            after_update=monitor.after_update,
        )
    finally:
        monitor.close(state, reason)
    wall_s = time.perf_counter() - started
    import ray

    buffer_status = ray.get(replay.status.remote(), timeout=60)
    return summarize(config, rundir, monitor, state, fleet.status(), reason, stop.signal_name, wall_s, buffer_status)
