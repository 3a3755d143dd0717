"""The step path of ``rollhub run``: build the object graph from a :class:`RunConfig` and run PPO on it.

The graph: a replay buffer (the ``writer``), a fleet of RolloutWorkers, each a StepRolloutManager over its
environments (``env``, ``policy``, ``fleet``): with ``fleet.backend = "ray"`` the buffer is a Ray actor and the
fleet a :class:`rollhub.rollout.backends.ray.RolloutFleet` of worker actors; with ``"local"`` both live in this process
(:class:`rollhub.rollout.backends.local.LocalFleet`, no Ray runtime); with ``"processes"`` the buffer does and each
worker is a process of its own (:class:`rollhub.rollout.backends.processes.ProcessFleet`, no Ray runtime). Then the
:class:`rollhub.train.ppo.PPOLearner` in this process (``trainer``), the weight publisher (``weights``) and a
:class:`rollhub.run.monitor.RunMonitor` (metrics, trackers, progress, checkpoints). Everything that can be
checked without starting anything (the environment builds and says its sizes) is checked first.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollhub.envs.step import EnvSpec, close_env, make_step_env
from rollhub.errors import ConfigError
from rollhub.run.config import CheckpointWeightsConfig, RunConfig, RunConfigError
from rollhub.run.fleet_reporter import report_fleet
from rollhub.run.report import WORKERS_AS
from rollhub.run.rundir import Resumed, RunDirectory
from rollhub.run.signals import StopSignals


@dataclass(frozen=True)
class EnvShape:
    """What the policy needs to know about the environment: flat observation size and discrete actions."""

    obs_dim: int
    n_actions: int


def env_spec(config: RunConfig) -> EnvSpec:
    """The picklable environment recipe of ``[env]``."""
    return EnvSpec(config.env.id, dict(config.env.kwargs), config.env.task)


def probe_env(config: RunConfig) -> EnvShape:
    """Build one environment here, reset it, take one step and read its sizes (``policy.obs_dim`` /
    ``n_actions`` win), so a mistake in the environment is refused before anything starts.

    Raises:
        RunConfigError: the environment cannot be built, lacks ``reset`` or ``step``, fails or answers in
            another shape on its first reset or step, or does not say how many actions it has.
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
    """The rollout fleet of ``[fleet]`` writing into ``replay`` (a Ray actor handle, or with
    ``fleet.backend = "local"`` or ``"processes"`` a :class:`ReplayBuffer` of this process)."""
    from rollhub.inference.mlp_policy import MLPStepPolicy
    from rollhub.rollout.backends.base import FleetConfig
    from rollhub.rollout.step.manager import StepManagerConfig, step_manager_factory
    from rollhub.rollout.worker import RolloutWorkerConfig

    fleet = config.fleet
    manager = StepManagerConfig(
        env=env_spec(config),
        n_envs=fleet.envs_per_worker,
        env_processes=fleet.env_processes,
        step_threads=fleet.step_threads,
        fragment_length=fleet.fragment_length,
        batch_wait_s=fleet.batch_wait_s,
        gamma=config.trainer.gamma,
        seed=config.run.seed,
    )
    policy = functools.partial(MLPStepPolicy, shape.obs_dim, shape.n_actions, config.policy.hidden)
    fleet_config = FleetConfig(
        n_workers=fleet.workers,
        worker_num_cpus=min(1.0, config.run.ray_num_cpus / fleet.workers),
        worker=RolloutWorkerConfig(
            max_staleness=config.writer.max_staleness,
            queue_size=fleet.queue_size,
            write_interval_s=fleet.write_interval_s,
            items_per_version=fleet.fragments_per_version,
        ),
    )
    factory = step_manager_factory(manager, policy)
    if fleet.backend == "local":
        from rollhub.rollout.backends.local import LocalFleet, LocalWriter

        return LocalFleet(fleet_config, factory, LocalWriter(replay))
    if fleet.backend == "processes":
        from rollhub.rollout.backends.local import LocalWriter
        from rollhub.rollout.backends.processes import ProcessFleet

        return ProcessFleet(fleet_config, factory, LocalWriter(replay))
    from rollhub.rollout.backends.ray import ActorWriter, FleetClient

    return FleetClient.start(fleet_config, factory, ActorWriter(replay))


def make_learner(config: RunConfig, shape: EnvShape, resumed: Resumed | None) -> Any:
    """The PPO learner of ``[trainer]``, restored from ``resumed`` when given."""
    from rollhub.train.ppo import PPOConfig, PPOLearner

    t = config.trainer
    ppo = PPOConfig(
        hidden=config.policy.hidden, lr=t.lr, lr_final=t.lr_final, gamma=t.gamma, gae_lambda=t.gae_lambda,
        clip=t.clip, clip_final=t.clip_final, anneal_steps=t.anneal_steps, clip_vf=t.clip_vf, vf_coef=t.vf_coef,
        ent_coef=t.ent_coef, epochs=t.epochs, minibatches=t.minibatches, minibatch_size=t.minibatch_size,
        norm_adv=t.norm_adv, max_grad_norm=t.max_grad_norm, seed=config.run.seed, backend=t.backend,
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


@dataclass(frozen=True)
class _Session:
    """What both fleet backends' runs start from."""

    config: RunConfig
    rundir: RunDirectory
    resumed: Resumed | None
    stop: StopSignals
    learner: Future[Any]
    started: float


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
    local = config.fleet.backend != "ray"
    note(f"{config.run.name}: loading {'torch' if local else 'Ray and torch'}...")
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    # The learner is built while the fleet starts (mostly waiting for processes): the first optimizer pulls in
    # about a second of torch's lazy imports that would otherwise compete with the fleet's start for the CPU.
    pool = ThreadPoolExecutor(1, thread_name_prefix="learner")
    session = _Session(config, rundir, resumed, stop, pool.submit(make_learner, config, shape, resumed), started)
    pool.shutdown(wait=False)
    if local:
        return _run_local(session, shape, note)
    return _run_ray(session, shape, note)


def _note_fleet(config: RunConfig, note: Callable[[str], None]) -> None:
    fleet = config.fleet
    where = WORKERS_AS[fleet.backend]
    note(f"{config.run.name}: starting {fleet.workers} rollout workers ({where}) x {fleet.envs_per_worker} envs...")


def _run_ray(session: _Session, shape: EnvShape, note: Callable[[str], None]) -> dict[str, Any]:
    """The step path on the Ray fleet: a replay-buffer actor and worker actors, this process trains."""
    import ray

    from rollhub.rollout.backends.ray import start_replay_buffer
    from rollhub.run.sources import RayReplaySource

    config = session.config
    note(f"{config.run.name}: starting Ray ({config.run.ray_num_cpus} CPUs)...")
    own_ray = start_ray(config, session.stop)
    fleet = None
    try:
        w = config.writer  # a resumed run's version reaches the buffer with the trainer's first publish
        replay = start_replay_buffer(w.batch_size, w.max_staleness, w.max_queued, w.storage)
        _note_fleet(config, note)
        fleet = start_fleet(config, shape, replay)

        def buffer_status() -> dict[str, Any]:
            return ray.get(replay.status.remote(), timeout=60)

        with report_fleet(config.run, fleet):  # run.metrics_port
            return _train(session, RayReplaySource(replay, fleet), buffer_status, fleet)
    finally:
        if fleet is not None:
            fleet.stop()
        if own_ray:
            ray.shutdown()


def _run_local(session: _Session, shape: EnvShape, note: Callable[[str], None]) -> dict[str, Any]:
    """The step path without Ray: buffer and trainer in this process, the workers threads of it (``"local"``) or
    processes of their own (``"processes"``)."""
    from rollhub.rollout.replay import ReplayBuffer
    from rollhub.run.sources import LocalReplaySource

    w = session.config.writer
    replay = ReplayBuffer(w.batch_size, w.max_staleness, w.max_queued, w.storage, in_process=True)
    _note_fleet(session.config, note)
    fleet = start_fleet(session.config, shape, replay)
    try:
        with report_fleet(session.config.run, fleet):  # run.metrics_port
            return _train(session, LocalReplaySource(replay, fleet), replay.status, fleet)
    finally:
        fleet.stop()


def _train(session: _Session, source: Any, buffer_status: Callable[[], dict[str, Any]], fleet: Any) -> dict[str, Any]:
    from rollhub.run.monitor import RunMonitor
    from rollhub.run.report import summarize
    from rollhub.train.ppo import PPOState, train_ppo

    config, resumed, stop = session.config, session.resumed, session.stop
    learner = session.learner.result()
    state = PPOState.restore(resumed.values["state"]) if resumed is not None else PPOState()
    monitor = RunMonitor(config, session.rundir, learner, fleet.statistics(), stop, resumed, started=session.started)
    reason = "not started"
    try:
        reason = train_ppo(
            learner,
            source,
            make_publisher(config, session.rundir, fleet),
            state,
            stop_reason=monitor.stop_reason,
            after_update=monitor.after_update,
        )
    finally:
        monitor.close(state, reason)
    wall_s = time.perf_counter() - session.started
    status = fleet.status()
    return summarize(config, session.rundir, monitor, state, status, reason, stop.signal_name, wall_s, buffer_status())
