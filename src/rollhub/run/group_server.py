"""The parts of a group run that writes to the buffer server (``writer.kind = "server"``, and the trainer-only
``env.kind = "external"``), each built from its own config section: the buffer server (a child ``rollhub serve``
unless ``writer.url`` is given) and the Ray fleet of group rollout workers writing to it.

:mod:`rollhub.run.assemble` starts them, the server first, and stops them in the opposite order, whatever ends
the run (the target, a limit, a signal, an error): the fleet, Ray (when this run started it), then the server
(when this run started it); the summary and the PNG are written either way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rollhub.curriculum import CurriculumConfig
from rollhub.rollout.group.manager import GroupRolloutManager
from rollhub.rollout.protocols import ExperienceWriter, Fleet
from rollhub.run.child_server import ChildServer
from rollhub.run.config import FleetSection
from rollhub.run.config_group import ServerWriterConfig, storage_path
from rollhub.run.rundir import Resumed, RunDirectory


def start_buffer(writer: ServerWriterConfig, rundir: RunDirectory, resumed: Resumed | None,
                 stamp_unversioned: bool = False) -> tuple[str, ChildServer | None]:  # fmt: skip
    """The server of ``[writer]``: its URL and the child server this run started (``None`` when ``writer.url`` is
    given); with ``stamp_unversioned`` the child stamps groups that arrive without a version
    (``--stamp-unversioned``)."""
    from rollhub.run.child_server import start_server

    if writer.url is not None:
        return writer.url.rstrip("/"), None
    storage = storage_path(writer.storage, rundir.root)
    if resumed is None and storage.startswith("sqlite:///"):
        for suffix in ("", "-wal", "-shm"):  # a fresh run must not serve a previous run's queue
            Path(storage[len("sqlite:///") :] + suffix).unlink(missing_ok=True)
    stamp = ["--stamp-unversioned"] if stamp_unversioned else []
    server = start_server(storage, "--max-staleness", str(writer.max_staleness), *stamp)
    return server.url, server


def start_group_fleet(fleet: FleetSection, curriculum: CurriculumConfig,
                      managers: Callable[[str], GroupRolloutManager], writer: ExperienceWriter, *,
                      max_staleness: int, groups_per_batch: int, tracker: str, seed: int,
                      ray_num_cpus: int) -> Fleet:  # fmt: skip
    """A Ray fleet of ``fleet.workers`` group rollout workers running ``managers`` and writing with ``writer``
    (Ray must be up): each queues two training batches' worth of groups (``groups_per_batch``), drops what is
    more than ``max_staleness`` versions old and, with ``fleet.admission``, waits while the server holds enough;
    ``tracker`` names each worker's tracker (``{worker_id}`` filled in)."""
    from rollhub.rollout.backends.base import FleetConfig
    from rollhub.rollout.backends.ray import FleetClient
    from rollhub.rollout.worker import RolloutWorkerConfig

    workers = fleet.workers
    admit = fleet.admission and max_staleness is not None
    worker = RolloutWorkerConfig(
        max_staleness=max_staleness,
        queue_size=2 * groups_per_batch,  # the queue holds groups: two training calls' worth
        tracker=tracker,
        seed=seed,
        admission_batch=groups_per_batch if admit else None,
        backlog_share=workers,
    )
    config = FleetConfig(n_workers=workers, worker_num_cpus=ray_num_cpus / (workers + 1), worker=worker)
    return FleetClient.start(config, managers, writer, curriculum=curriculum)
