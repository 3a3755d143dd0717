"""The one assembler of ``rollhub run``: it reads the :class:`RunConfig` and builds the parts of a run, handing
each builder only its own config section and what the assembler gives it (another part, a figure of another
section).

A step run (:func:`assemble_step`) is a replay buffer (``[writer]``: a Ray actor, or with ``fleet.backend =
"local"`` or ``"processes"`` an object of this process), the fleet that writes into it (``[fleet]``, its managers
from ``[env]`` and ``[policy]``; a :class:`~rollhub.rollout.protocols.Fleet`), the source the trainer reads, the
PPO learner (``[trainer]``), the weight publisher (``[weights]``), the trackers (``[[trackers]]``) and the
monitor (``[run]``). A group run (:func:`assemble_group`) is the policy backend (``[policy]`` and
``[inference]``; a :class:`~rollhub.run.backend.PolicyBackend`), the writer (``in_process``: a rollout manager
of this process; ``server``: the buffer server and a Ray fleet of group workers; ``external``: the server alone,
the environment being another process), the source, the GRPO trainer and its publisher, the trackers and the
monitor (``[run]`` and ``[eval]``).

Both assemblers are context managers: they start the parts in order, yield them, and stop what they started in
the opposite order whatever ends the run (the reporter, the fleet, Ray when this run started it, the server when
this run started it, the engines); the loops of :mod:`rollhub.run.step` and :mod:`rollhub.run.group` train on
what they yield.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollhub.curriculum import CurriculumConfig
from rollhub.rollout.protocols import Fleet
from rollhub.run.backend import PolicyBackend
from rollhub.run.config import CheckpointWeightsConfig, RunConfig
from rollhub.run.fleet_reporter import report_fleet
from rollhub.run.report import WORKERS_AS
from rollhub.run.rundir import Resumed, RunDirectory
from rollhub.run.signals import StopSignals
from rollhub.run.step_parts import EnvShape, env_spec, make_learner, start_fleet, start_ray, step_managers

#: What a step run's replay buffer gives the assembler: the fleet writing into it, the trainer's source, its status.
Replay = tuple[Fleet, "FragmentSource", Callable[[], dict[str, Any]]]

if TYPE_CHECKING:
    from rollhub.client.trackers import Tracker
    from rollhub.client.trainer import TrainerClient
    from rollhub.run.group_monitor import GroupMonitor
    from rollhub.run.llm import EngineBackend
    from rollhub.run.monitor import RunMonitor
    from rollhub.run.run_metrics import RunMetrics
    from rollhub.train.grpo import GroupSource, GRPOTrainer
    from rollhub.train.ppo import PPOLearner, PPOState
    from rollhub.train.sources import FragmentSource
    from rollhub.weights.base import WeightPublisher


@dataclass(frozen=True)
class StepParts:
    """A step run, assembled: what :func:`rollhub.run.step.run_step_path` trains with."""

    fleet: Fleet
    source: FragmentSource
    buffer_status: Callable[[], dict[str, Any]]
    learner: PPOLearner
    publisher: WeightPublisher
    monitor: RunMonitor
    state: PPOState


@dataclass(frozen=True)
class GroupParts:
    """A group run, assembled: what :func:`rollhub.run.group.run_group_path` trains with; ``extra()`` gives the
    summary's fields of the writer and the backend once training ended."""

    backend: PolicyBackend
    trainer: GRPOTrainer
    source: GroupSource
    monitor: GroupMonitor
    extra: Callable[[], dict[str, Any]]


# ---- the parts, each from its own section ------------------------------------------------------------
def trackers(config: RunConfig, rundir: RunDirectory) -> list[Tracker]:
    """The ``[[trackers]]``, initialised with the run's name and its effective config."""
    from rollhub.run.monitor import make_trackers

    return make_trackers(config.trackers, rundir, config.run.name, config.model_dump(mode="json"))


def step_fleet(config: RunConfig, shape: EnvShape, replay: Any) -> Fleet:
    """The fleet of ``[fleet]``, its managers acting in ``[env]`` with the ``[policy]`` of ``shape``, writing into
    ``replay``."""
    managers = step_managers(config.fleet, env_spec(config.env), config.policy, shape, gamma=config.trainer.gamma,
                             seed=config.run.seed)  # fmt: skip
    return start_fleet(config.fleet, managers, replay, max_staleness=config.writer.max_staleness,
                       ray_num_cpus=config.run.ray_num_cpus)  # fmt: skip


def ppo_learner(config: RunConfig, shape: EnvShape, resumed: Resumed | None) -> PPOLearner:
    """The PPO learner of ``[trainer]`` for ``[policy]``'s width, restored from ``resumed`` when given."""
    return make_learner(config.trainer, shape, resumed, hidden=config.policy.hidden, seed=config.run.seed)


def engine_backend(config: RunConfig, rundir: RunDirectory, note: Callable[[str], None],
                   stop: Callable[[], bool] | None = None) -> EngineBackend:  # fmt: skip
    """The vLLM engines of ``[inference]`` serving ``[policy]`` (one per worker with ``inference.per_worker`` on
    a fleet), started unless ``stop()`` turns true first."""
    from rollhub.run.llm import EngineBackend

    inference = config.inference
    engines = config.fleet.workers if inference.per_worker and config.writer.kind == "server" else 1
    return EngineBackend(config.policy, inference, rundir, note, stop, name=config.run.name, seed=config.run.seed,
                         engines=engines, sampling=config.sampling.overrides(),
                         mismatch_warn=config.trainer.mismatch_warn)  # fmt: skip


def policy_backend(config: RunConfig, rundir: RunDirectory, note: Callable[[str], None],
                   stop: Callable[[], bool] | None = None) -> PolicyBackend:  # fmt: skip
    """The run's :class:`~rollhub.run.group_parts.LocalBackend`, or for ``policy.kind = "hf"`` its
    :func:`engine_backend`."""
    from rollhub.run.group_parts import LocalBackend

    if config.policy.kind != "hf":
        return LocalBackend(config.policy, config.run.seed, config.sampling.overrides())
    return engine_backend(config, rundir, note, stop)


def grpo_trainer(config: RunConfig, resumed: Resumed | None, model: Any) -> GRPOTrainer:
    """The GRPO trainer of ``[trainer]`` on ``model``, with ``env.group_size``, the
    ``[sampling]`` distribution and the precision of ``[policy]``."""
    from rollhub.run.group_parts import make_trainer
    from rollhub.train.precision import Precision

    return make_trainer(config.trainer, model, resumed, precision=Precision.for_policy(config.policy),
                        group_size=config.env.group_size,
                        sampling=config.sampling.overrides())  # fmt: skip


def weights_publisher(config: RunConfig, rundir: RunDirectory, backend: PolicyBackend,
                      deliver: Callable[[int, dict[str, Any]], None] | None) -> Callable:  # fmt: skip
    """The group trainer's ``publish``: to ``backend`` and ``deliver`` in ``[policy]``'s dtype, and with
    ``weights.kind = "checkpoint"`` into the checkpoints of ``[weights]``."""
    from rollhub.run.group_parts import publisher
    from rollhub.train.precision import Precision
    from rollhub.weights.checkpoint import CheckpointDirectory, CheckpointPublisher

    weights, checkpoints = config.weights, None
    if isinstance(weights, CheckpointWeightsConfig):
        checkpoints = CheckpointPublisher(CheckpointDirectory(rundir.root / weights.dir, weights.keep_last))
    return publisher(backend, deliver, precision=Precision.for_policy(config.policy), checkpoints=checkpoints)


def group_fleet(config: RunConfig, rundir: RunDirectory, curriculum: CurriculumConfig, url: str, seed: int,
                backend: PolicyBackend) -> Fleet:  # fmt: skip
    """The Ray fleet of ``[fleet]`` sampling through ``backend`` and writing to the server at ``url``."""
    from rollhub.rollout.writers.http_writer import HttpWriter
    from rollhub.run.group_server import start_group_fleet

    writer = HttpWriter(url, config.run.name, config.env.group_size, config.policy.max_len)
    return start_group_fleet(
        config.fleet, curriculum, backend.manager_factory(curriculum), writer,
        max_staleness=config.writer.max_staleness, groups_per_batch=config.trainer.groups_per_batch,
        tracker=f"jsonl:{rundir.root.resolve()}/{{worker_id}}.jsonl", seed=seed, ray_num_cpus=config.run.ray_num_cpus,
    )  # fmt: skip


def _trainer_client(config: RunConfig, url: str, stack: contextlib.ExitStack) -> TrainerClient:
    """A trainer client of the server at ``url``, registered for the run's batches (closed with ``stack``)."""
    from rollhub.client.trainer import TrainerClient

    client = TrainerClient(url)
    stack.callback(client.close)
    batch = config.trainer.groups_per_batch * config.env.group_size
    client.register(batch_size=batch, max_token_len=config.policy.max_len, num_steps=config.run.max_updates or 10**9)
    return client


def _group_monitor(config: RunConfig, rundir: RunDirectory, trainer: GRPOTrainer,
                   curriculum: CurriculumConfig | None, shared: Any, stop: StopSignals, resumed: Resumed | None,
                   started: float, backend: PolicyBackend, metrics: RunMetrics) -> GroupMonitor:  # fmt: skip
    from rollhub.run.group_monitor import GroupMonitor

    env_name = config.env.name if config.env.kind == "external" else config.env.id
    return GroupMonitor(config.run, config.eval, rundir, trainer, curriculum, shared, stop, resumed, started,
                        backend, trackers(config, rundir), env_name, metrics)  # fmt: skip


def _run_metrics(config: RunConfig, backend: PolicyBackend, resumed: Resumed | None, fleet: Fleet | None,
                 url: str | None, stack: contextlib.ExitStack) -> RunMetrics:  # fmt: skip
    """The run's own figures (continued from ``resumed``), reported with ``fleet``'s to the server at ``url`` and
    on ``run.metrics_port`` while the run lasts."""
    from rollhub.run.run_metrics import RunMetrics, run_versions

    metrics = RunMetrics(backend.engine_reads, run_versions(resumed))
    stack.enter_context(report_fleet(config.run, fleet, url, metrics.figures))
    return metrics


# ---- a step run ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def assemble_step(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
                  note: Callable[[str], None], shape: EnvShape, started: float) -> Iterator[StepParts]:  # fmt: skip
    """Start the parts of a step run (the learner is built while the fleet starts); yield them; stop them."""
    from rollhub.run.monitor import RunMonitor
    from rollhub.run.step_parts import make_publisher
    from rollhub.train.ppo import PPOState

    # The learner is built while the fleet starts (mostly waiting for processes): the first optimizer pulls in
    # about a second of torch's lazy imports that would otherwise compete with the fleet's start for the CPU.
    pool = ThreadPoolExecutor(1, thread_name_prefix="learner")
    learner = pool.submit(ppo_learner, config, shape, resumed)
    pool.shutdown(wait=False)
    with contextlib.ExitStack() as stack:
        if config.fleet.backend == "ray":
            fleet, source, buffer_status = _ray_replay(config, shape, stop, note, stack)
        else:
            fleet, source, buffer_status = _local_replay(config, shape, note, stack)
        stack.enter_context(report_fleet(config.run, fleet))  # run.metrics_port
        monitor = RunMonitor(config.run, rundir, learner.result(), fleet.statistics(), stop, trackers(config, rundir),
                             resumed, started)  # fmt: skip
        state = PPOState.restore(resumed.values["state"]) if resumed is not None else PPOState()
        publisher = make_publisher(config.weights, rundir, fleet)
        yield StepParts(fleet, source, buffer_status, monitor.learner, publisher, monitor, state)


def _note_fleet(config: RunConfig, note: Callable[[str], None]) -> None:
    fleet = config.fleet
    where = WORKERS_AS[fleet.backend]
    note(f"{config.run.name}: starting {fleet.workers} rollout workers ({where}) x {fleet.envs_per_worker} envs...")


def _ray_replay(config: RunConfig, shape: EnvShape, stop: StopSignals, note: Callable[[str], None],
                stack: contextlib.ExitStack) -> Replay:  # fmt: skip
    """Ray, a replay-buffer actor and a fleet of worker actors; this process trains."""
    import ray

    from rollhub.rollout.backends.ray import start_replay_buffer
    from rollhub.run.sources import RayReplaySource

    note(f"{config.run.name}: starting Ray ({config.run.ray_num_cpus} CPUs)...")
    if start_ray(config.run.ray_num_cpus, stop):
        stack.callback(ray.shutdown)
    w = config.writer  # a resumed run's version reaches the buffer with the trainer's first publish
    replay = start_replay_buffer(w.batch_size, w.max_staleness, w.max_queued, w.storage)
    _note_fleet(config, note)
    fleet = step_fleet(config, shape, replay)
    stack.callback(fleet.stop)

    def buffer_status() -> dict[str, Any]:
        return ray.get(replay.status.remote(), timeout=60)

    return fleet, RayReplaySource(replay, fleet), buffer_status


def _local_replay(config: RunConfig, shape: EnvShape, note: Callable[[str], None],
                  stack: contextlib.ExitStack) -> Replay:  # fmt: skip
    """The buffer in this process, the workers threads of it (``"local"``) or processes of their own
    (``"processes"``); no Ray."""
    from rollhub.rollout.replay import ReplayBuffer
    from rollhub.run.sources import LocalReplaySource

    w = config.writer
    replay = ReplayBuffer(w.batch_size, w.max_staleness, w.max_queued, w.storage, in_process=True)
    _note_fleet(config, note)
    fleet = step_fleet(config, shape, replay)
    stack.callback(fleet.stop)
    return fleet, LocalReplaySource(replay, fleet), replay.status


# ---- a group run ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def assemble_group(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
                   note: Callable[[str], None], curriculum: CurriculumConfig | None,
                   started: float) -> Iterator[GroupParts]:  # fmt: skip
    """Start the policy backend and the parts of the run's writer; yield them; stop them. When sampling fails
    (:class:`~rollhub.inference.openai_client.InferenceError`) the backend is checked first, so a dead engine is
    named (its pid, exit code and log) rather than "no answer"."""
    from rollhub.inference.openai_client import InferenceError

    external = config.env.kind == "external"
    if external:
        from rollhub.run.external import ENDPOINTS

        (rundir.root / ENDPOINTS).unlink(missing_ok=True)  # a watcher must never read a previous session's
    with contextlib.ExitStack() as stack:
        engines = engine_backend(config, rundir, note, lambda: stop.requested) if external else None
        backend = engines if engines is not None else policy_backend(config, rundir, note, lambda: stop.requested)
        stack.callback(backend.close)
        try:
            if engines is not None:
                parts = _external(config, rundir, resumed, stop, note, curriculum, started, engines, stack)
            else:
                assert curriculum is not None  # a group environment always has its lessons
                build = _in_process if config.writer.kind == "in_process" else _server
                parts = build(config, rundir, resumed, stop, note, curriculum, started, backend, stack)
            yield parts
        except InferenceError:
            backend.check()
            raise


def _sessions_seed(config: RunConfig, resumed: Resumed | None) -> int:
    from rollhub.run.group_parts import sessions_before

    return config.run.seed + sessions_before(resumed)


def _in_process(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
                note: Callable[[str], None], curriculum: CurriculumConfig, started: float, backend: PolicyBackend,
                stack: contextlib.ExitStack) -> GroupParts:  # fmt: skip
    """One rollout manager in this process filling the trainer's queue."""
    from rollhub.curriculum import SharedCurriculum
    from rollhub.run.run_metrics import VersionTap
    from rollhub.run.sources import InProcessGroupSource

    note(f"{config.run.name} (in-process): building the policy, the trainer and the evaluator...")
    shared = SharedCurriculum(curriculum)
    if resumed is not None and resumed.values.get("curriculum"):
        shared.load_state_dict(resumed.values["curriculum"])
    manager = backend.manager_factory(curriculum)("local-0")
    stack.callback(manager.shutdown)
    batch = config.trainer.groups_per_batch * config.env.group_size
    source = InProcessGroupSource(manager, shared, batch, seed=_sessions_seed(config, resumed),
                                  max_staleness=config.writer.max_staleness)  # fmt: skip
    trainer = grpo_trainer(config, resumed, backend.trainer_model())
    deliver = source.offer_weights if backend.ships_weights() else source.offer_version
    trainer.publish = weights_publisher(config, rundir, backend, deliver)
    metrics = _run_metrics(config, backend, resumed, None, None, stack)  # run.metrics_port only
    monitor = _group_monitor(config, rundir, trainer, curriculum, shared, stop, resumed, started, backend, metrics)
    return GroupParts(backend, trainer, VersionTap(source, metrics), monitor,
                      lambda: {"variant": "in-process", **backend.summary()})  # fmt: skip


def _server(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
            note: Callable[[str], None], curriculum: CurriculumConfig, started: float, backend: PolicyBackend,
            stack: contextlib.ExitStack) -> GroupParts:  # fmt: skip
    """The buffer server, Ray and a fleet of group workers writing to it (sampling through ``backend``)."""
    import ray

    from rollhub.curriculum.actor import RemoteCurriculum
    from rollhub.run.group_server import start_buffer
    from rollhub.run.run_metrics import VersionTap
    from rollhub.run.sources import ServerGroupSource

    name = config.run.name
    note(f"{name}: starting the buffer server...")
    url, server = start_buffer(config.writer, rundir, resumed)
    if server is not None:
        stack.callback(server.stop)
    note(f"{name}: server on {url}; starting Ray ({config.run.ray_num_cpus} CPUs)...")
    if start_ray(config.run.ray_num_cpus, stop):
        stack.callback(ray.shutdown)
    note(f"{name}: starting {config.fleet.workers} rollout worker(s) and the trainer...")
    fleet = group_fleet(config, rundir, curriculum, url, _sessions_seed(config, resumed), backend)
    stack.callback(fleet.stop)
    metrics = _run_metrics(config, backend, resumed, fleet, url, stack)  # POST /fleet, and run.metrics_port
    shared = RemoteCurriculum(fleet.curriculum(), curriculum)
    if resumed is not None and resumed.values.get("curriculum"):
        shared.load_state_dict(resumed.values["curriculum"])
    client = _trainer_client(config, url, stack)
    trainer = grpo_trainer(config, resumed, backend.trainer_model())
    # an engine holds its weights: then the fleet only reads its version
    trainer.publish = weights_publisher(config, rundir, backend, fleet.publish if backend.ships_weights() else None)

    def check() -> None:
        fleet.check()
        backend.check()

    source = ServerGroupSource(client, config.writer.lease_s, on_empty=check,
                               max_staleness=config.writer.max_staleness)  # fmt: skip
    monitor = _group_monitor(config, rundir, trainer, curriculum, shared, stop, resumed, started, backend, metrics)

    def extra() -> dict[str, Any]:
        status, raw = fleet.status(), client.status().raw
        return {
            "variant": "distributed",
            "workers": config.fleet.workers,
            "max_staleness": config.writer.max_staleness,
            "worker_restarts": status["restarts"],
            "groups_written": sum(w.get("items_sent", 0) for w in status["workers"]),
            "worker_dropped_groups": sum(w.get("dropped_groups", 0) for w in status["workers"]),
            "aborted_groups": sum(w.get("aborted_groups", 0) for w in status["workers"]),
            "admission_waits": sum(w.get("admission_waits", 0) for w in status["workers"]),
            "admission_wait_s": round(sum(w.get("admission_wait_s", 0.0) for w in status["workers"]), 1),
            "weights_waits": sum(w.get("weights_waits", 0) for w in status["workers"]),
            "capped_turns": sum(w.get("capped_turns", 0) for w in status["workers"]),
            "server_stale_dropped": raw.get("stale_dropped", raw.get("stale")),
            **backend.summary(),
        }

    return GroupParts(backend, trainer, VersionTap(source, metrics), monitor, extra)


def _external(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
              note: Callable[[str], None], curriculum: CurriculumConfig | None, started: float,
              backend: EngineBackend, stack: contextlib.ExitStack) -> GroupParts:  # fmt: skip
    """The buffer server alone: the environment is another process that samples through ``backend``'s engine and
    posts its groups; the endpoints are written and announced once the trainer is ready."""
    from rollhub.curriculum import SharedCurriculum
    from rollhub.run.external import ProbeTap, endpoints_of
    from rollhub.run.group_server import start_buffer
    from rollhub.run.run_metrics import VersionTap
    from rollhub.run.sources import ServerGroupSource

    note(f"{config.run.name}: starting the buffer server...")
    url, server = start_buffer(config.writer, rundir, resumed, stamp_unversioned=True)  # Atropos: no version
    if server is not None:
        stack.callback(server.stop)
    endpoints = endpoints_of(url, backend, config.env.group_size, config.policy.max_len)
    client = _trainer_client(config, url, stack)
    trainer = grpo_trainer(config, resumed, backend.trainer_model())
    trainer.publish = weights_publisher(config, rundir, backend, None)
    shared = SharedCurriculum(curriculum) if curriculum is not None else None
    source: GroupSource = ServerGroupSource(client, config.writer.lease_s, on_empty=backend.check,
                                            max_staleness=config.writer.max_staleness)  # fmt: skip
    metrics = _run_metrics(config, backend, resumed, None, url, stack)  # POST /fleet, and run.metrics_port
    monitor = _group_monitor(config, rundir, trainer, curriculum, shared, stop, resumed, started, backend, metrics)
    endpoints.write(rundir)
    endpoints.announce(config.run.name)

    def extra() -> dict[str, Any]:
        raw = client.status().raw
        return {
            "variant": "external",
            "server_url": endpoints.server_url,
            "max_staleness": config.writer.max_staleness,
            "server_stale_dropped": raw.get("stale_dropped", raw.get("stale")),
            **backend.summary(),
        }

    if curriculum is None:
        source = ProbeTap(source, monitor)
    return GroupParts(backend, trainer, VersionTap(source, metrics), monitor, extra)
