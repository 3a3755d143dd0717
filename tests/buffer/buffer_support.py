"""Builders shared by the buffer tests (registrations, env requests, tagged groups)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from rollhub.buffer import BufferConfig, EnvRequest, ExperienceBuffer, Ingested, TrainerRun
from rollhub.buffer.sqlite import SqliteStorage
from rollhub.experience import Group, Ragged
from rollhub.server import shapes
from rollhub.server.storage import GROUP_CODEC


def registration(batch_size: int = 8, starting_step: int = 0, **overrides: object) -> TrainerRun:
    """A trainer's run with test defaults (what ``POST /register`` gives the core)."""
    fields: dict[str, object] = {
        "wandb_group": "group",
        "wandb_project": "project",
        "batch_size": batch_size,
        "max_token_len": 2048,
        "checkpoint_dir": "/ckpt",
        "save_checkpoint_interval": 10,
        "starting_step": starting_step,
        "num_steps": 100,
    }
    fields.update(overrides)
    return TrainerRun(**fields)  # type: ignore[arg-type]


def scored(results: list[Ingested]) -> list[dict[str, Any]]:
    """Ingest results as the JSON ``POST /scored_data`` answers for each group."""
    return [shapes.scored_data(r) for r in results]


def env_request(
    group_size: int = 4,
    name: str = "env",
    weight: float = 1.0,
    max_token_length: int = 512,
    min_batch_allocation: float | None = None,
) -> EnvRequest:
    return EnvRequest(
        max_token_length=max_token_length,
        desired_name=name,
        weight=weight,
        group_size=group_size,
        min_batch_allocation=min_batch_allocation,
    )


def make_group(
    tokens: list[int],
    env_id: int | None = None,
    policy_version: int | None = None,
) -> Group:
    """A group with one sequence per token id: sequence i is ``[tokens[i], tokens[i]]``.

    The token ids tag sequences so tests can follow every sequence through the buffer.
    """
    rows = [np.array([t, t], dtype=np.int32) for t in tokens]
    return Group(
        tokens=Ragged.from_rows(rows, np.int32),
        masks=Ragged.from_rows(rows, np.int32),
        scores=np.arange(len(tokens), dtype=np.float64),
        env_id=env_id,
        policy_version=policy_version,
    )


def served_tokens(batch: Any) -> list[int]:
    """The tag of every sequence in a served batch, in order."""
    return [int(row[0]) for item in batch.items for row in item.tokens.rows()]


def heavy_group(tag: int, rows: int = 4, length: int = 4096) -> Group:
    """About 130 KB stored: heavy enough to move the WAL quickly."""
    data = np.full(rows * length, tag, dtype=np.int32)
    offsets = np.arange(rows + 1, dtype=np.int64) * length
    return Group(tokens=Ragged(data, offsets), masks=Ragged(data.copy(), offsets), scores=np.ones(rows))


def reference_status_env(server: Any, buffer: ExperienceBuffer, env_id: int, *, batch_size: int, step: int) -> Any:
    """Run 0.4.0's own ``get_status_env`` (``server`` is ``atroposlib.api.server``) on ``buffer``'s envs and queue."""
    state = server.app.state
    state.envs = [
        {
            "max_context_len": e.max_token_length,
            "weight": e.weight,
            "registered_id": e.env_id,
            "connected": e.connected,
            "min_batch_allocation": e.min_batch_allocation,
            "group_size": e.group_size,
            "desired_name": e.desired_name,
        }
        for e in buffer.envs
    ]
    state.queue = [{"tokens": [[0]] * e.size, "env_id": e.env_id} for e in buffer.queued()]
    state.batchsize = batch_size
    state.status_dict = {"step": step}
    try:
        return asyncio.run(server.get_status_env(server.EnvIdentifier(env_id=env_id)))
    finally:
        for name in ("envs", "queue", "batchsize", "status_dict"):
            delattr(state, name)


def open_sqlite_buffer(path: Path, **options: object) -> ExperienceBuffer:
    """A buffer on ``SqliteStorage(path, codec=GROUP_CODEC, **options)``, with a trainer of batch size 4 registered
    unless the database already holds one (a reopened buffer keeps its run)."""
    buffer = ExperienceBuffer(SqliteStorage(path, codec=GROUP_CODEC, **options), BufferConfig())  # type: ignore[arg-type]
    if buffer.run is None:
        buffer.register_trainer(registration(batch_size=4))
    return buffer


def drain(buffer: ExperienceBuffer) -> list[int]:
    """The first token of every group served until no batch forms, in serving order."""
    return [int(g.tokens.data[0]) for b in iter(buffer.next_batch, None) for g in b.items]
