"""The parts of a trainer-only run (``env.kind = "external"``): the buffer server, the inference engine and the
GRPO trainer, with the environment a process of its own (an Atropos ``BaseEnv`` in ``serve`` mode, or anything
that speaks the AtroposLib API).

The run starts the server (a child ``rollhub serve`` unless ``writer.url`` is given) and the engine (unless
``inference.url`` is given), then says where they are: on stderr, and in ``RUN_DIR/endpoints.json``
(:class:`Endpoints`), which is written once both answer. The environment samples through the engine's OpenAI
base URL with the served model name and posts scored groups to the server; the trainer registers, pulls leased
batches, trains, and pushes every version into the engine. No Ray runtime and no rollout worker is started.

:func:`rollhub.run.assemble.assemble_group` builds the run; this module holds what only it needs: the
:class:`Endpoints` and the :class:`ProbeTap`. Shutdown order, whatever ends the run: the engine (when this run
started it) and the server (likewise); the summary and the PNG are written either way. The environment is not
this run's to stop: it sees the server go.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollhub.experience import Group
from rollhub.run.rundir import RunDirectory
from rollhub.run.sources import SourceTap

if TYPE_CHECKING:
    from rollhub.run.group_monitor import GroupMonitor
    from rollhub.run.llm import EngineBackend
    from rollhub.train.grpo import GroupSource

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


class ProbeTap(SourceTap):
    """A group source that hands the first batch's prompts to the monitor's engine probe when no evaluation
    gives it prompts (the probe measures the engine against the trainer on prompts of the task)."""

    def __init__(self, source: GroupSource, monitor: GroupMonitor) -> None:
        super().__init__(source)
        self.monitor = monitor

    def saw(self, batch: Sequence[Group]) -> None:
        """Hand the batch's prompts to the probe, once."""
        from rollhub.run.probe import probe_prompts

        if not self.monitor.probe:
            self.monitor.probe = probe_prompts(batch)


def endpoints_of(server_url: str, backend: EngineBackend, group_size: int, max_token_len: int) -> Endpoints:
    """Where an external environment reaches the run: the server at ``server_url`` and ``backend``'s first
    engine (a local model directory as an absolute path, since the environment may run elsewhere)."""
    model = backend.model
    return Endpoints(
        server_url=server_url, openai_base_url=f"{backend.urls[0]}/v1", model_name=backend.served_name,
        tokenizer=str(Path(model).resolve()) if Path(model).is_dir() else model, group_size=group_size,
        max_token_len=max_token_len,
    )  # fmt: skip
