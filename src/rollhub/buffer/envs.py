"""The environment registry: what ``/register-env`` records and the ``/status-env`` arithmetic.

The arithmetic is AtroposLib 0.4.0's, because Atropos's BaseEnv decides when to pause from it
(``queue_size * group_size >= max_batches_offpolicy * batch_size``): ``queue_size`` is in units of the asking
env's group size and counts its own queued sequences plus, for every other env, its queued sequences rounded
up to whole packs of the largest group size, less that env's guaranteed minimum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from rollhub.buffer.storage import Entry
from rollhub.errors import InvalidInput, NotRegistered, UnknownEnv
from rollhub.wire.models import RegisterEnv

MIN_ENV_WEIGHT = 0.01


@dataclass
class EnvRecord:
    """One registered environment (env ids are positions in the registry and are never reused)."""

    env_id: int
    desired_name: str
    wandb_name: str
    max_token_length: int
    weight: float
    group_size: int
    min_batch_allocation: float | None = None
    connected: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def validate_register_env(req: RegisterEnv) -> None:
    """Reject registrations that cannot work (0.4.0 accepts them and misbehaves later)."""
    if req.group_size < 1:
        raise InvalidInput(f"group_size is {req.group_size}; it must be at least 1", field="group_size")
    if not math.isfinite(req.weight) or req.weight < 0:
        raise InvalidInput(f"weight is {req.weight}; it must be a finite number >= 0", field="weight")
    if req.max_token_length < 0:
        raise InvalidInput(f"max_token_length is {req.max_token_length}; it must be >= 0", field="max_token_length")
    m = req.min_batch_allocation
    if m is not None and not (0.0 <= m <= 1.0):
        raise InvalidInput(f"min_batch_allocation is {m}; it must be between 0.0 and 1.0", field="min_batch_allocation")


def new_record(envs: list[EnvRecord], req: RegisterEnv) -> EnvRecord:
    """The record for a new env: next id, and a W&B name unique among envs of the same desired name."""
    k = sum(1 for e in envs if e.desired_name == req.desired_name)
    return EnvRecord(
        env_id=len(envs),
        desired_name=req.desired_name,
        wandb_name=f"{req.desired_name}_{k}",
        max_token_length=req.max_token_length,
        weight=req.weight,
        group_size=req.group_size,
        min_batch_allocation=req.min_batch_allocation,
    )


def minimums(envs: Iterable[EnvRecord]) -> dict[int, float]:
    """env_id -> minimum fraction, for connected envs that set one."""
    return {e.env_id: e.min_batch_allocation for e in envs if e.connected and e.min_batch_allocation is not None}


def status_env(envs: list[EnvRecord], env_id: int, queue: list[Entry], batch_size: int, step: int) -> dict[str, Any]:
    """The ``/status-env`` answer for ``env_id`` (0.4.0 arithmetic, see the module docstring)."""
    if not 0 <= env_id < len(envs):
        raise UnknownEnv(
            f"env_id {env_id} is not registered ({len(envs)} envs known); call /register-env first",
            field="env_id",
        )
    connected = [e for e in envs if e.connected]
    total = sum(e.max_token_length * max(0.0, e.weight) for e in connected)
    if total <= 0:
        raise NotRegistered("no connected environment has max_token_length * weight > 0; register an environment first")
    env = envs[env_id]
    env_weight = max(MIN_ENV_WEIGHT, env.max_token_length * env.weight / total)
    unallocated = 1.0 - min(sum(minimums(envs).values()), 1.0)
    max_group = 1
    own_group = env.group_size
    own_seqs = 0
    others: dict[int | None, int] = {}
    for e in queue:
        max_group = max(max_group, e.size)
        if e.env_id == env_id:
            own_group = max(own_group, e.size)
            own_seqs += e.size
        else:
            others[e.env_id] = others.get(e.env_id, 0) + e.size
    floor = {k: int(batch_size * v) for k, v in minimums(envs).items()}
    available = 0
    if max_group > 1:
        for other, seqs in others.items():
            packed = math.ceil(seqs / max_group) * max_group
            available += max(0, packed - floor.get(other, 0))  # type: ignore[arg-type]
    return {
        "current_step": step,
        "queue_size": (own_seqs + available) // own_group,
        "unallocated_fraction": unallocated,
        "self_queue_size": own_seqs // own_group,
        "max_group_size": max_group,
        "env_weight": env_weight,
    }


def find_combination(sizes: list[int], target: int) -> list[int]:
    """Indices of held groups whose sizes add up to ``target``: first-fit in arrival order, else any
    subset (preferring earlier groups). Empty when none exists."""
    chosen, total = [], 0
    for i, s in enumerate(sizes):
        if total + s <= target:
            chosen.append(i)
            total += s
            if total == target:
                return chosen
    # reach[j] = the earliest-ending subset reaching sum j, as a tuple of indices
    reach: dict[int, tuple[int, ...]] = {0: ()}
    for i, s in enumerate(sizes):
        for j, combo in list(reach.items()):
            k = j + s
            if k <= target and k not in reach:
                reach[k] = (*combo, i)
        if target in reach:
            return list(reach[target])
    return []
