"""AtroposLib's JSON answers, written from the buffer core's typed values.

The core (:mod:`rollhub.buffer`) answers with dataclasses; every route writes them through the functions below,
which give the exact JSON of AtroposLib 0.4.0 (key names and order), plus rollhub's documented extra keys; and
turns request bodies into the core's values (``/register``, ``/register-env``, ``/policy-version``). No web
framework: the contract tests of the core use them too.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from pydantic import BaseModel, Field

from rollhub.buffer import (
    BufferStatus,
    EnvRegistration,
    EnvRequest,
    EnvStatus,
    Ingested,
    TrainerRun,
    VersionPublished,
)
from rollhub.buffer.envs import WAIT_ANSWER
from rollhub.wire.models import RegisterEnv, Registration, WireInt


class PolicyVersionRequest(BaseModel):
    """``POST /policy-version``: the number of weight updates the trainer has published (initial weights: 0)."""

    policy_version: Annotated[WireInt, Field(ge=0, examples=[3])]


def trainer_run(registration: Registration) -> TrainerRun:
    """``POST /register``'s body as the core's :class:`TrainerRun`."""
    return TrainerRun(**registration.model_dump())


def env_request(body: RegisterEnv) -> EnvRequest:
    """``POST /register-env``'s body as the core's :class:`EnvRequest`."""
    return EnvRequest(
        desired_name=body.desired_name,
        max_token_length=body.max_token_length,
        weight=body.weight,
        group_size=body.group_size,
        min_batch_allocation=body.min_batch_allocation,
    )


def info(run: TrainerRun | None) -> dict[str, Any]:
    """``GET /info``: batch size (sequences) and max token length; -1 before ``/register``."""
    if run is None:
        return {"batch_size": -1, "max_token_len": -1}
    return {"batch_size": run.batch_size, "max_token_len": run.max_token_len}


def wandb_info(run: TrainerRun | None) -> dict[str, Any]:
    """``GET /wandb_info``: the trainer's W&B group and project (null before ``/register``)."""
    if run is None:
        return {"group": None, "project": None}
    return {"group": run.wandb_group, "project": run.wandb_project}


def status(s: BufferStatus) -> dict[str, Any]:
    """``GET /status``: 0.4.0's ``current_step`` and ``queue_size``, then rollhub's figures.

    :class:`BufferStatus` declares its fields in the answer's key order.
    """
    return asdict(s)


def register_env(r: EnvRegistration) -> dict[str, Any]:
    """``POST /register-env``: ``success`` with the env's id and names, or ``wait for trainer to start``."""
    if r.env is None or r.run is None:
        return {"status": WAIT_ANSWER}
    return {
        "status": "success",
        "env_id": r.env.env_id,
        "wandb_name": r.env.wandb_name,
        "checkpoint_dir": r.run.checkpoint_dir,
        "starting_step": r.starting_step,
        "checkpoint_interval": r.run.save_checkpoint_interval,
        "num_steps": r.run.num_steps,
    }


def disconnected() -> dict[str, Any]:
    """``POST /disconnect-env`` for a known env."""
    return {"status": "success"}


def disconnect_failed(env_id: int) -> dict[str, Any]:
    """``POST /disconnect-env`` for an env_id never issued: 0.4.0 answers 200 with a failure object."""
    return {"status": "failure", "error": f"env_id {env_id} is not registered"}


def status_env(s: EnvStatus) -> dict[str, Any]:
    """``GET /status-env``: 0.4.0's figures (:class:`EnvStatus` declares them in 0.4.0's key order)."""
    return asdict(s)


def scored_data(r: Ingested) -> dict[str, Any]:
    """``POST /scored_data``: ``received``, or ``buffered`` with the sequences held for the env."""
    if r.held_sequences is None:
        return {"status": "received"}
    return {"status": "buffered", "buffer_size": r.held_sequences}


def scored_data_list(results: list[Ingested]) -> dict[str, Any]:
    """``POST /scored_data_list``: groups processed, and how many were held (with the last held count)."""
    response: dict[str, Any] = {"status": "received", "groups_processed": len(results)}
    buffered = [r for r in results if r.held_sequences is not None]
    if buffered:
        response["buffered"] = len(buffered)
        response["last_buffer_size"] = buffered[-1].held_sequences
    return response


def version_published(r: VersionPublished) -> dict[str, Any]:
    """``POST /policy-version``: the version now current and the items it made too stale."""
    return {"policy_version": r.policy_version, "stale_dropped": r.stale_dropped}
