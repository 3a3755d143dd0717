"""The trainer-only run (``env.kind = "external"``): the buffer server, the inference engine and the GRPO trainer,
with the environment a process of its own (an Atropos ``BaseEnv`` in ``serve`` mode, or anything that speaks the
AtroposLib API).

The run starts the server (a child ``rollhub serve`` unless ``writer.url`` is given) and the engine (unless
``inference.url`` is given), then says where they are: on stderr, and in ``RUN_DIR/endpoints.json``
(:class:`Endpoints`), which is written once both answer. The environment samples through the engine's OpenAI
base URL with the served model name and posts scored groups to the server; the trainer registers, pulls leased
batches, trains, and pushes every version into the engine. No Ray runtime and no rollout worker is started.

Shutdown order, whatever ends the run: the engine (when this run started it) and the server (likewise); the
summary and the PNG are written either way. The environment is not this run's to stop: it sees the server go.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollhub.curriculum import CurriculumConfig
from rollhub.experience import Group
from rollhub.run.config import RunConfig
from rollhub.run.group_parts import make_trainer, publisher
from rollhub.run.rundir import Resumed, RunDirectory
from rollhub.run.signals import StopSignals

ENDPOINTS = "endpoints.json"


@dataclass(frozen=True)
class Endpoints:
    """What an external environment needs to reach the run.

    Attributes:
        server_url: the buffer server (Atropos: ``--env.rollout_server_url``).
        openai_base_url: the engine's OpenAI-compatible routes (Atropos: ``--openai.base_url``).
        model_name: the engine's served model name (Atropos: ``--openai.model_name``).
        tokenizer: the model directory or hub name whose tokenizer the engine uses (Atropos:
            ``--env.tokenizer_name``).
        group_size: the group size the trainer's batches count on (Atropos: ``--env.group_size``).
        max_token_len: the longest sequence the trainer registered (the environment drops longer groups).
    """

    server_url: str
    openai_base_url: str
    model_name: str
    tokenizer: str
    group_size: int
    max_token_len: int

    def atropos_flags(self) -> list[str]:
        """The command-line flags of an Atropos environment's ``serve`` that point it at this run."""
        return [
            "--env.rollout_server_url", self.server_url, "--env.tokenizer_name", self.tokenizer,
            "--env.group_size", str(self.group_size), "--openai.base_url", self.openai_base_url,
            "--openai.model_name", self.model_name, "--openai.server_type", "openai", "--openai.api_key", "x",
        ]  # fmt: skip

    def write(self, rundir: RunDirectory) -> None:
        """``RUN_DIR/endpoints.json``, written whole (a watcher never reads half of it)."""
        path = rundir.root / ENDPOINTS
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    def announce(self, name: str) -> None:
        """Print where the environment should point (stderr, whether or not progress lines are on)."""
        lines = [
            f"{name}: waiting for an external environment; point it at",
            f"  buffer server        {self.server_url}",
            f"  OpenAI base URL      {self.openai_base_url}",
            f"  served model name    {self.model_name}",
            f"  tokenizer            {self.tokenizer}",
            f"  group size           {self.group_size}",
            f"  e.g. an Atropos environment: python ENV.py serve {' '.join(self.atropos_flags())}",
        ]
        print("\n".join(lines), file=sys.stderr, flush=True)


class _ProbeTap:
    """A group source that hands the first batch's prompts to the monitor's engine probe when no evaluation
    gives it prompts (the probe measures the engine against the trainer on prompts of the task)."""

    def __init__(self, source: Any, monitor: Any) -> None:
        self.source, self.monitor = source, monitor

    @property
    def stale_groups(self) -> int:
        return self.source.stale_groups

    @property
    def batches_skipped(self) -> int:
        return self.source.batches_skipped

    def next_batch(self, wait_s: float) -> Sequence[Group] | None:
        from rollhub.run.probe import probe_prompts

        groups = self.source.next_batch(wait_s)
        if groups and not self.monitor.probe:
            self.monitor.probe = probe_prompts(groups)
        return groups

    def ack(self) -> None:
        self.source.ack()

    def publish_version(self, version: int) -> None:
        self.source.publish_version(version)


def _absolute(model: str) -> str:
    """A local model directory as an absolute path (the environment may run elsewhere); a hub name as given."""
    return str(Path(model).resolve()) if Path(model).is_dir() else model


def run_external(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
                 note: Callable[[str], None], curriculum: CurriculumConfig | None, started: float,
                 backend: Any) -> dict[str, Any]:  # fmt: skip
    """Start the server, announce the endpoints, train on what the environment sends; return the summary."""
    from rollhub.run.group_server import start_buffer

    note(f"{config.run.name}: starting the buffer server...")
    url, server = start_buffer(config, rundir, resumed, stamp_unversioned=True)  # Atropos groups carry no version
    try:
        endpoints = Endpoints(
            server_url=url, openai_base_url=f"{backend.urls[0]}/v1", model_name=backend.served_name,
            tokenizer=_absolute(backend.model), group_size=config.env.group_size, max_token_len=config.policy.max_len,
        )  # fmt: skip
        return _train(config, rundir, resumed, stop, curriculum, endpoints, started, backend)
    finally:
        if server is not None:
            server.stop()


def _train(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
           curriculum: CurriculumConfig | None, endpoints: Endpoints, started: float,
           backend: Any) -> dict[str, Any]:  # fmt: skip
    from rollhub.client.trainer import TrainerClient
    from rollhub.curriculum import SharedCurriculum
    from rollhub.run.group_monitor import GroupMonitor, train_and_report
    from rollhub.run.sources import ServerGroupSource

    client = TrainerClient(endpoints.server_url)
    batch = config.trainer.groups_per_batch * config.env.group_size
    client.register(batch_size=batch, max_token_len=config.policy.max_len, num_steps=config.run.max_updates or 10**9)
    trainer = make_trainer(config, resumed, backend.trainer_model())
    trainer.publish = publisher(config, rundir, backend, None)
    shared = SharedCurriculum(curriculum) if curriculum is not None else None
    source = ServerGroupSource(
        client, config.writer.lease_s, on_empty=backend.check, max_staleness=config.writer.max_staleness
    )
    monitor = GroupMonitor(config, rundir, trainer, curriculum, shared, stop, resumed, started, backend)
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

    try:
        return train_and_report(monitor, _ProbeTap(source, monitor) if curriculum is None else source, extra)
    finally:
        client.close()
