"""Property tests of the buffer core on both backends.

Random runs of registrations, ingests (power-of-two group sizes, several envs, some with minimum
allocations, some smaller than the env's group size and so held and merged), batch pulls (plain, leased and
acknowledged, leased and left to expire), clock ticks and restarts. Every sequence carries a unique token
id; the model checks that none is lost or consumed twice, that every batch has exactly ``batch_size``
sequences, that expired leases come back whole as the same step, that minimum allocations hold as the rule
guarantees, and that nothing stale is served.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from buffer_support import env_request, make_group, registration, served_tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollhub.buffer import Batch, BufferConfig, ExperienceBuffer, Storage, make_storage
from rollhub.buffer.storage import Entry
from rollhub.errors import QueueFull
from rollhub.server.storage import GROUP_CODEC

BATCH_SIZE = 8
LEASE_S = 10.0


@dataclass
class EnvSpec:
    group_size: int
    minimum: float | None


@dataclass
class Scenario:
    envs: list[EnvSpec]
    max_staleness: int | None
    max_queued: int | None
    ops: list[tuple]


def _env_spec() -> st.SearchStrategy[EnvSpec]:
    # A minimum's share int(8 * m) is a multiple of the env's group size, so the first pass of the rule
    # can meet it exactly; see _check_minimums.
    return st.one_of(
        st.builds(EnvSpec, st.sampled_from([1, 2, 4, 8]), st.none()),
        st.builds(EnvSpec, st.sampled_from([1, 2]), st.just(0.25)),
        st.builds(EnvSpec, st.sampled_from([1, 2, 4]), st.just(0.5)),
    )


_INGEST = st.tuples(
    st.just("ingest"),
    st.integers(-1, 2),  # env index; -1 = no env
    st.sampled_from([1, 2, 4, 8]),  # size, capped at the env's group size
    st.one_of(st.none(), st.integers(0, 3)),  # how many steps behind the producing policy is
    st.integers(1, 4),  # groups in the request
)
_PULL = st.tuples(st.just("pull"), st.sampled_from(["plain", "plain", "ack", "expire"]))
# Repeated branches weigh the draw: mostly ingests and pulls, now and then a tick or a restart.
_OPS = st.one_of(_INGEST, _INGEST, _INGEST, _PULL, _PULL, st.tuples(st.just("tick")), st.tuples(st.just("restart")))
STARTING_STEP = 3  # so policy versions can lag behind from the first batch on


@st.composite
def scenarios(draw: st.DrawFn, max_ops: int) -> Scenario:
    envs = draw(st.lists(_env_spec(), min_size=1, max_size=3))
    if sum(int(BATCH_SIZE * e.minimum) for e in envs if e.minimum) > BATCH_SIZE:
        envs = [EnvSpec(e.group_size, None) if i else e for i, e in enumerate(envs)]
    return Scenario(
        envs=envs,
        max_staleness=draw(st.one_of(st.none(), st.integers(0, 2))),
        max_queued=draw(st.one_of(st.none(), st.sampled_from([16, 32]))),
        ops=draw(st.lists(_OPS, min_size=max_ops // 2, max_size=max_ops)),
    )


@dataclass
class Model:
    """What the test knows independently of the buffer."""

    accepted: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)  # tag -> env, version
    exact: set[int] = field(default_factory=set)  # tags queued as their own group (never merged)
    consumed: set[int] = field(default_factory=set)
    leases: dict[str, tuple[frozenset[int], int, float]] = field(default_factory=dict)  # id -> tags, step, due
    next_tag: int = 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _packable_sequences(queue: list[Entry], env_id: int) -> int:
    """Sequences of ``env_id`` that complete packs of the largest queued group size (the rule's pool)."""
    largest = max(e.size for e in queue)
    counts: dict[int, int] = {}
    for e in queue:
        if e.env_id == env_id:
            counts[e.size] = counts.get(e.size, 0) + 1
    return sum((n * size // largest) * largest for size, n in counts.items())


def _check_minimums(batch: Batch, before: list[Entry], specs: list[EnvSpec]) -> None:
    """Each env with a minimum gets min(its share, what it could pack) sequences (shares fit the batch)."""
    by_env: dict[int | None, int] = {}
    for e in batch.entries:
        by_env[e.env_id] = by_env.get(e.env_id, 0) + e.size
    for env_id, spec in enumerate(specs):
        if spec.minimum is None:
            continue
        share = int(BATCH_SIZE * spec.minimum)
        pool = _packable_sequences(before, env_id)
        assert pool > 0, f"a batch was formed though env {env_id} with a minimum had nothing packable"
        assert by_env.get(env_id, 0) >= min(share, pool), (env_id, by_env, share, pool)


def run_scenario(scenario: Scenario, open_storage: Callable[[], Storage], reopen: Callable[[Storage], Storage]) -> None:
    clock = Clock()
    config = BufferConfig(max_staleness=scenario.max_staleness, max_queued_sequences=scenario.max_queued)
    storage: Storage = open_storage()
    buffer = ExperienceBuffer(storage, config, clock=clock)
    buffer.register_trainer(registration(BATCH_SIZE, starting_step=STARTING_STEP))
    buffer.mark_started()
    for spec in scenario.envs:
        buffer.register_env(env_request(group_size=spec.group_size, min_batch_allocation=spec.minimum))
    model = Model()

    def check_batch(batch: Batch, stale_filtered: list[Entry]) -> None:
        tags = served_tokens(batch)
        assert len(tags) == BATCH_SIZE == batch.sequences
        assert len(set(tags)) == len(tags)
        assert not set(tags) & model.consumed, "a consumed sequence was served again"
        live = {t for tags_, _, due in model.leases.values() if due >= clock.now for t in tags_}
        assert not set(tags) & live, "a sequence under an open lease was served"
        assert set(tags) <= set(model.accepted)
        expired = {lid: v for lid, v in model.leases.items() if v[2] < clock.now}
        if expired:
            match = [lid for lid, (t, step, _) in expired.items() if t == frozenset(tags)]
            assert match, "an expired lease was not served again whole and first"
            assert batch.step == expired[match[0]][1]
            del model.leases[match[0]]
        else:
            if scenario.max_staleness is not None:
                for t in tags:
                    version = model.accepted[t][1]
                    assert version is None or version >= batch.step - scenario.max_staleness
            if any(s.minimum for s in scenario.envs):
                _check_minimums(batch, stale_filtered, scenario.envs)

    def pull(mode: str) -> Batch | None:
        step = buffer.status().current_step
        limit = scenario.max_staleness
        fresh = [
            e for e in buffer.queued() if limit is None or e.policy_version is None or e.policy_version >= step - limit
        ]
        batch = buffer.next_batch(lease_s=None if mode == "plain" else LEASE_S)
        if batch is None:
            return None
        check_batch(batch, fresh)
        tags = frozenset(served_tokens(batch))
        if mode == "plain":
            model.consumed |= tags
        elif mode == "ack":
            buffer.ack(batch.batch_id)  # type: ignore[arg-type]
            model.consumed |= tags
        else:
            model.leases[batch.batch_id] = (tags, batch.step, clock.now + LEASE_S)  # type: ignore[index]
        return batch

    for op in scenario.ops:
        kind = op[0]
        if kind == "ingest":
            _, env_index, size, behind, count = op
            env_id = env_index if 0 <= env_index < len(scenario.envs) else None
            if env_id is not None:
                size = min(size, scenario.envs[env_id].group_size)
            step = buffer.status().current_step
            version = None if behind is None else max(0, step - behind)
            tags = list(range(model.next_tag, model.next_tag + size * count))
            model.next_tag += size * count
            groups = [make_group(tags[i : i + size], env_id, version) for i in range(0, len(tags), size)]
            try:
                buffer.ingest(groups)
            except QueueFull:
                continue
            for t in tags:
                model.accepted[t] = (env_id, version)
            if env_id is None or size == scenario.envs[env_id].group_size:
                model.exact.update(tags)
        elif kind == "pull":
            pull(op[1])
        elif kind == "tick":
            clock.now += LEASE_S + 1
        else:
            buffer = ExperienceBuffer(reopen(storage), config, clock=clock)

    # Drain: every open lease expires and comes back; take everything that can be served.
    clock.now += LEASE_S + 1
    while pull("plain") is not None:
        pass
    assert not model.leases
    stored = buffer.storage.load()
    assert all(item.state != "leased" for item in stored.items)
    remaining: list[int] = []
    for item in buffer.storage.payloads([i.entry.gid for i in stored.items]):
        remaining += [int(r[0]) for r in item.tokens.rows()]
    assert len(set(remaining)) == len(remaining)
    assert not set(remaining) & model.consumed
    dropped = set(model.accepted) - model.consumed - set(remaining)
    assert set(remaining) <= set(model.accepted)
    status = buffer.status()
    assert status.queued_sequences + status.held_sequences == len(remaining)
    if scenario.max_staleness is None:
        assert not dropped, "sequences were lost"
        return
    final = status.current_step
    stale_envs = {k for k, v in status.stale_dropped.items() if v}
    for t in dropped:
        env_id, version = model.accepted[t]
        assert str(env_id) in stale_envs
        if t in model.exact:
            assert version is not None and version < final - scenario.max_staleness, (t, version, final)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(max_ops=60))
def test_memory_backend_never_loses_or_repeats_a_sequence(scenario: Scenario) -> None:
    shared = make_storage("memory")
    run_scenario(scenario, lambda: shared, lambda old: old)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(max_ops=40))
def test_sqlite_backend_never_loses_or_repeats_a_sequence(scenario: Scenario) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'buf.db'}"
        opened: list[Storage] = []

        def open_storage() -> Storage:
            opened.append(make_storage(url, GROUP_CODEC))
            return opened[-1]

        def reopen(old: Storage) -> Storage:
            old.close()
            return open_storage()

        try:
            run_scenario(scenario, open_storage, reopen)
        finally:
            for storage in opened:
                storage.close()
