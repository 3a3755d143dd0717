"""The ``server`` writer of a group run: the buffer server, a Ray fleet of group rollout workers writing to it,
and the GRPO trainer pulling leased batches from it (see :mod:`rollhub.run.group`).

Shutdown order, whatever ends the run (the target, a limit, a signal, an error): the fleet, Ray (when this
run started it), then the server (when this run started it); the summary and the PNG are written either way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollhub.curriculum import CurriculumConfig
from rollhub.run.config import RunConfig
from rollhub.run.config_group import storage_path
from rollhub.run.fleet_reporter import report_fleet
from rollhub.run.group_parts import LocalBackend, make_trainer, publisher, sessions_before
from rollhub.run.rundir import Resumed, RunDirectory
from rollhub.run.signals import StopSignals


def start_buffer(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None,
                 stamp_unversioned: bool = False) -> tuple[str, Any]:  # fmt: skip
    """The server's URL and the child server this run started (``None`` when ``writer.url`` is given); with
    ``stamp_unversioned`` the child stamps groups that arrive without a version (``--stamp-unversioned``)."""
    from rollhub.run.child_server import start_server

    writer = config.writer
    if writer.url is not None:
        return writer.url.rstrip("/"), None
    storage = storage_path(writer.storage, rundir.root)
    if resumed is None and storage.startswith("sqlite:///"):
        for suffix in ("", "-wal", "-shm"):  # a fresh run must not serve a previous run's queue
            Path(storage[len("sqlite:///") :] + suffix).unlink(missing_ok=True)
    stamp = ["--stamp-unversioned"] if stamp_unversioned else []
    server = start_server(storage, "--max-staleness", str(writer.max_staleness), *stamp)
    return server.url, server


def start_group_fleet(config: RunConfig, rundir: RunDirectory, curriculum: CurriculumConfig, url: str,
                      seed: int, backend: Any) -> Any:  # fmt: skip
    """A fleet of ``fleet.workers`` group rollout workers writing to the server at ``url`` (Ray must be up)."""
    from rollhub.rollout.backends.base import FleetConfig
    from rollhub.rollout.backends.ray import FleetClient
    from rollhub.rollout.worker import RolloutWorkerConfig
    from rollhub.rollout.writers.http_writer import HttpWriter

    writer = HttpWriter(url, config.run.name, config.env.group_size, config.policy.max_len)
    workers, bound = config.fleet.workers, config.writer.max_staleness
    admit = config.fleet.admission and bound is not None
    worker = RolloutWorkerConfig(
        max_staleness=bound,
        queue_size=2 * config.trainer.groups_per_batch,  # the queue holds groups: two training calls' worth
        tracker=f"jsonl:{rundir.root.resolve()}/{{worker_id}}.jsonl",
        seed=seed,
        admission_batch=config.trainer.groups_per_batch if admit else None,
        backlog_share=workers,
    )
    fleet = FleetConfig(n_workers=workers, worker_num_cpus=config.run.ray_num_cpus / (workers + 1), worker=worker)
    return FleetClient.start(fleet, backend.manager_factory(curriculum), writer, curriculum=curriculum)


def run_server_variant(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
                       note: Callable[[str], None], curriculum: CurriculumConfig, started: float,
                       backend: Any) -> dict[str, Any]:  # fmt: skip
    """Start the server, Ray, the fleet (sampling through ``backend``); train; stop them in that order; return
    the summary."""
    import ray

    from rollhub.run.step import start_ray

    note(f"{config.run.name}: starting the buffer server...")
    url, server = start_buffer(config, rundir, resumed)
    fleet, own_ray = None, False
    try:
        note(f"{config.run.name}: server on {url}; starting Ray ({config.run.ray_num_cpus} CPUs)...")
        own_ray = start_ray(config, stop)
        note(f"{config.run.name}: starting {config.fleet.workers} rollout worker(s) and the trainer...")
        seed = config.run.seed + sessions_before(resumed)
        fleet = start_group_fleet(config, rundir, curriculum, url, seed, backend)
        with report_fleet(config.run, fleet, url):  # POST /fleet, and run.metrics_port
            return _train(config, rundir, resumed, stop, curriculum, url, fleet, started, backend)
    finally:
        if fleet is not None:
            fleet.stop()
        if own_ray:
            ray.shutdown()
        if server is not None:
            server.stop()


def _train(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
           curriculum: CurriculumConfig, url: str, fleet: Any, started: float,
           backend: Any) -> dict[str, Any]:  # fmt: skip
    from rollhub.client.trainer import TrainerClient
    from rollhub.curriculum.actor import RemoteCurriculum
    from rollhub.run.group_monitor import GroupMonitor, train_and_report
    from rollhub.run.sources import ServerGroupSource

    shared = RemoteCurriculum(fleet.curriculum(), curriculum)
    if resumed is not None and resumed.values.get("curriculum"):
        shared.load_state_dict(resumed.values["curriculum"])
    client = TrainerClient(url)
    batch = config.trainer.groups_per_batch * config.env.group_size
    client.register(batch_size=batch, max_token_len=config.policy.max_len, num_steps=config.run.max_updates or 10**9)
    trainer = make_trainer(config, resumed, backend.trainer_model())
    local = isinstance(backend, LocalBackend)  # an engine holds its weights: the fleet only reads its version
    trainer.publish = publisher(config, rundir, backend, fleet.publish if local else None)

    def check() -> None:
        fleet.check()
        backend.check()

    source = ServerGroupSource(client, config.writer.lease_s, on_empty=check, max_staleness=config.writer.max_staleness)
    monitor = GroupMonitor(config, rundir, trainer, curriculum, shared, stop, resumed, started, backend)

    def extra() -> dict[str, Any]:
        status, raw = fleet.status(), client.status().raw
        return {
            "variant": "distributed",
            "workers": config.fleet.workers,
            "max_staleness": config.writer.max_staleness,
            "worker_restarts": status["restarts"],
            "groups_written": sum(w.get("items_sent", 0) for w in status["workers"]),
            "admission_waits": sum(w.get("admission_waits", 0) for w in status["workers"]),
            "admission_wait_s": round(sum(w.get("admission_wait_s", 0.0) for w in status["workers"]), 1),
            "server_stale_dropped": raw.get("stale_dropped", raw.get("stale")),
            **backend.summary(),
        }

    try:
        return train_and_report(monitor, source, extra)
    finally:
        client.close()
