"""The environment registry: what ``/register-env`` records, its answers, and the ``/status-env`` arithmetic.

The arithmetic is AtroposLib 0.4.0's, because Atropos's BaseEnv decides when to pause from it
(``queue_size * group_size >= max_batches_offpolicy * batch_size``): ``queue_size`` is in units of the asking
env's group size and counts its own queued sequences plus, for every other env, its queued sequences rounded
up to whole packs of the largest group size, less that env's guaranteed minimum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from rollhub.buffer.types import TrainerRun
from rollhub.errors import InvalidInput, NotRegistered, UnknownEnv
from rollhub.experience import Group
from rollhub.experience.episodes import episode_count

if TYPE_CHECKING:
    from rollhub.buffer.queue import EnvQueued

MIN_ENV_WEIGHT = 0.01
MAX_GROUP_SIZE = 65_536
"""Largest ``group_size`` ``/register-env`` accepts: it bounds the work of combining held groups."""
MAX_COMBINE_CELLS = 2**25
"""Cap on the subset-sum cells one combining search visits (a few milliseconds at ``MAX_GROUP_SIZE``)."""


@dataclass(frozen=True)
class EnvRequest:
    """An environment asking to be registered (the server builds it from ``POST /register-env``'s body).

    Attributes:
        desired_name: the name it asks for (its W&B name gets a suffix unique among envs of that name).
        max_token_length: the longest sequence it sends.
        weight: its share of the sampling weight.
        group_size: sequences per whole group; smaller groups are held until they add up to it.
        min_batch_allocation: the fraction of every batch it must fill (None: no minimum).
    """

    desired_name: str
    max_token_length: int
    weight: float
    group_size: int
    min_batch_allocation: float | None = None


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


def validate_register_env(req: EnvRequest) -> None:
    """Reject registrations that cannot work (0.4.0 accepts them and misbehaves later)."""
    if not 1 <= req.group_size <= MAX_GROUP_SIZE:
        raise InvalidInput(
            f"group_size is {req.group_size}; it must be between 1 and {MAX_GROUP_SIZE} "
            "(the largest group the server combines held groups into)",
            field="group_size",
        )
    if not math.isfinite(req.weight) or req.weight < 0:
        raise InvalidInput(f"weight is {req.weight}; it must be a finite number >= 0", field="weight")
    if req.max_token_length < 0:
        raise InvalidInput(f"max_token_length is {req.max_token_length}; it must be >= 0", field="max_token_length")
    m = req.min_batch_allocation
    if m is not None and not (0.0 <= m <= 1.0):
        raise InvalidInput(f"min_batch_allocation is {m}; it must be between 0.0 and 1.0", field="min_batch_allocation")


def new_record(envs: list[EnvRecord], req: EnvRequest) -> EnvRecord:
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


@dataclass(frozen=True)
class EnvRegistration:
    """The answer to an environment registering.

    Attributes:
        env: the new env's record; ``None`` when the trainer has not asked for its first batch yet, and the
            environment should register again shortly (nothing was registered).
        run: the trainer's run (``None`` only when ``env`` is ``None``).
        starting_step: the trainer step now.
    """

    env: EnvRecord | None
    run: TrainerRun | None
    starting_step: int


@dataclass(frozen=True)
class EnvStatus:
    """AtroposLib 0.4.0's ``/status-env`` figures for one env, in its key order (see :func:`status_env`).

    ``queue_size`` and ``self_queue_size`` are in units of the env's group size.
    """

    current_step: int
    queue_size: int
    unallocated_fraction: float
    self_queue_size: int
    max_group_size: int
    env_weight: float


WAIT_ANSWER = "wait for trainer to start"
"""What ``/register-env`` answers (and registers nothing) until the trainer's first ``GET /batch``."""


def why_unregistered(started: bool, waited: int) -> str:
    """What to do about an env_id the server never issued: ``started`` is whether the trainer has asked for a
    batch; ``waited`` how many registrations were answered :data:`WAIT_ANSWER` (so none was made)."""
    if not started:
        return (
            "no trainer has called GET /batch yet, and until it does /register-env answers "
            f"{WAIT_ANSWER!r} and registers nothing; register again after the trainer starts"
        )
    if waited:
        return (
            f"/register-env answered {WAIT_ANSWER!r} {waited} time(s) because no trainer had called GET /batch yet, "
            "and registered nothing; register again now that the trainer has started, and use the env_id it returns"
        )
    return "use the env_id that /register-env returned, or leave it out"


def check_group(envs: list[EnvRecord], group: Group, why: str = "") -> EnvRecord | None:
    """The env a group belongs to (None: it names none), or raise before anything of the request is stored.
    ``why`` is what to do about an env_id never issued (:func:`why_unregistered`).

    Raises:
        InvalidInput: the env_id was never issued, or the group has more sequences than the env's group size.
    """
    if group.env_id is None:
        return None
    if not 0 <= group.env_id < len(envs):
        raise InvalidInput(
            f"env_id {group.env_id} is not registered ({len(envs)} envs known); {why or why_unregistered(True, 0)}",
            field="env_id",
        )
    env = envs[group.env_id]
    if (size := episode_count(group)) > env.group_size:
        raise InvalidInput(
            f"group has {size} sequences but env {env.env_id} registered group_size {env.group_size}; "
            "send at most group_size sequences per group (smaller groups are combined)",
            field="tokens",
        )
    return env


def minimums(envs: Iterable[EnvRecord]) -> dict[int, float]:
    """env_id -> minimum fraction, for connected envs that set one."""
    return {e.env_id: e.min_batch_allocation for e in envs if e.connected and e.min_batch_allocation is not None}


def status_env(
    envs: list[EnvRecord],
    env_id: int,
    queued: Mapping[int | None, EnvQueued],
    batch_size: int,
    step: int,
    why: str = "call /register-env first",
) -> EnvStatus:
    """The ``/status-env`` figures for ``env_id`` (0.4.0 arithmetic, see the module docstring).

    ``queued`` is the queue per env (:meth:`rollhub.buffer.queue.Queue.by_env`): the cost is in the number of
    envs and group sizes, not in the length of the queue. ``why`` says what to do about an env_id never issued.
    """
    if not 0 <= env_id < len(envs):
        raise UnknownEnv(
            f"env_id {env_id} is not registered ({len(envs)} envs known); {why}",
            field="env_id",
        )
    connected = [e for e in envs if e.connected]
    total = sum(e.max_token_length * max(0.0, e.weight) for e in connected)
    if total <= 0:
        raise NotRegistered("no connected environment has max_token_length * weight > 0; register an environment first")
    env = envs[env_id]
    env_weight = max(MIN_ENV_WEIGHT, env.max_token_length * env.weight / total)
    unallocated = 1.0 - min(sum(minimums(envs).values()), 1.0)
    max_group = max((max(row.sizes) for row in queued.values()), default=1)
    own = queued.get(env_id)
    own_group = max(env.group_size, max(own.sizes)) if own is not None else env.group_size
    own_seqs = own.sequences if own is not None else 0
    floor = {k: int(batch_size * v) for k, v in minimums(envs).items()}
    available = 0
    if max_group > 1:
        for other, row in queued.items():
            if other != env_id:
                packed = math.ceil(row.sequences / max_group) * max_group
                available += max(0, packed - floor.get(other, 0))  # type: ignore[arg-type]
    return EnvStatus(
        current_step=step,
        queue_size=(own_seqs + available) // own_group,
        unallocated_fraction=unallocated,
        self_queue_size=own_seqs // own_group,
        max_group_size=max_group,
        env_weight=env_weight,
    )


@dataclass
class CombineWork:
    """What one :func:`find_combination` call cost, so the bound on per-request work can be checked.

    Attributes:
        cells: subset-sum table cells visited (one per reachable-sum slot per size step).
        capped: whether the search stopped at ``max_cells`` without an answer.
    """

    cells: int = 0
    capped: bool = False


def find_combination(
    sizes: list[int], target: int, work: CombineWork | None = None, max_cells: int = MAX_COMBINE_CELLS
) -> list[int]:
    """Indices (ascending) of held groups whose sizes add up to ``target``: first-fit in arrival order, else a
    subset-sum search over the distinct sizes that takes the earliest groups of each size. Empty when none
    exists, or when the search would visit more than ``max_cells`` cells (the groups stay held; a later
    group may complete them). The cost is O(len(sizes)) plus at most ``max_cells`` cells, whatever the input.
    """
    work = work if work is not None else CombineWork()
    if sum(sizes) < target:  # no subset can reach it: the common case of a group still filling up
        return []
    chosen, total = [], 0
    for i, s in enumerate(sizes):
        if total + s <= target:
            chosen.append(i)
            total += s
            if total == target:
                return chosen
    return _subset_by_size(sizes, target, work, max_cells)


def _subset_by_size(sizes: list[int], target: int, work: CombineWork, max_cells: int) -> list[int]:
    """Bounded subset sum: each distinct size is one item of multiplicity ``min(count, target // size)``,
    split in binary chunks (1, 2, 4, ... copies); reachable sums are bits of an integer, so one step is one
    shift-or over ``target + 1`` bits, recorded so the chosen chunks can be read back."""
    by_size: dict[int, list[int]] = {}  # size -> indices in arrival order (sizes in order of first arrival)
    for i, s in enumerate(sizes):
        if 0 < s <= target:
            by_size.setdefault(s, []).append(i)
    chunks: list[tuple[int, int]] = []
    for s, indices in by_size.items():
        left, step = min(len(indices), target // s), 1
        while left > 0:
            chunks.append((s, min(step, left)))
            left -= chunks[-1][1]
            step *= 2
    mask, reach, before = (1 << (target + 1)) - 1, 1, []
    for s, copies in chunks:
        if work.cells + target + 1 > max_cells:
            work.capped = True
            return []
        work.cells += target + 1
        before.append(reach)
        reach = (reach | (reach << (s * copies))) & mask
        if reach >> target & 1:
            break
    else:
        return []
    used: dict[int, int] = {}
    j = target
    for (s, copies), prior in zip(reversed(chunks[: len(before)]), reversed(before), strict=True):
        if not prior >> j & 1:  # j is not reachable without this chunk: it is part of the answer
            j -= s * copies
            used[s] = used.get(s, 0) + copies
    return sorted(i for s, n in used.items() for i in by_size[s][:n])
