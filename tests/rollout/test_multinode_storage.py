"""What a buffer restarted on another node relies on, as plain Python: fragments stored in SQLite and read back."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from rollhub.errors import ConfigError
from rollhub.experience import SampleFragment
from rollhub.rollout.backends.base import FleetConfig
from rollhub.rollout.backends.ray import start_replay_buffer
from rollhub.rollout.replay import ReplayBuffer
from rollhub.rollout.step.fragment_store import decode_fragment, encode_fragment, make_fragment_storage


def _fragment(i: int, length: int = 3, state: bool = False) -> SampleFragment:
    rng = np.random.default_rng(i)
    f32 = rng.standard_normal(length).astype(np.float32)
    return SampleFragment(
        obs=rng.standard_normal((length, 2, 2)).astype(np.float32), actions=rng.integers(0, 4, length),
        rewards=f32, terminated=f32 > 1, truncated=f32 < -1, logp=-np.abs(f32), values=f32 * 2, final_values=f32 * 0,
        bootstrap_obs=np.full((2, 2), i, np.float32), bootstrap_value=float(i) / 3,
        state_in=rng.standard_normal(5).astype(np.float64) if state else None,
        versions=np.arange(length, dtype=np.int64) + i, episode_ids=np.full(length, i, np.int64),
        worker_id=f"w{i % 2}", env_index=i, task="cartpole/é", created_at=1234.5 + i,
    )  # fmt: skip


def _assert_same(a: SampleFragment, b: SampleFragment) -> None:
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, np.ndarray):
            assert other.dtype == value.dtype and other.shape == value.shape, name
            np.testing.assert_array_equal(other, value, err_msg=name)
        else:
            assert other == value, name


@pytest.mark.parametrize("state", [False, True])
def test_fragment_codec_round_trips_every_field(state: bool) -> None:
    fragment = _fragment(7, state=state)
    back = decode_fragment(encode_fragment(fragment))
    _assert_same(fragment, back)
    back.rewards[0] = 99.0  # decoded arrays are the reader's own
    assert fragment.rewards[0] != 99.0


def test_fragment_codec_refuses_what_it_cannot_store_or_read() -> None:
    with pytest.raises(TypeError, match="SampleFragment"):
        encode_fragment({"obs": 1})  # type: ignore[arg-type]
    f = _fragment(1)
    with pytest.raises(TypeError, match="'obs' holds Python objects"):
        encode_fragment(SampleFragment(**{**vars(f), "obs": np.array([{}, {}, {}], dtype=object)}))
    blob = encode_fragment(f)
    for bad in (b"", b"nope", blob[:-1], blob + b"x", b"RHF1" + blob[4:8] + b"{"):
        with pytest.raises(ValueError):
            decode_fragment(bad)


def test_sqlite_replay_buffer_reopened_serves_what_it_acknowledged(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'replay.db'}"
    first = ReplayBuffer(batch_size=2, max_staleness=100, storage=url)
    fragments = [_fragment(i, state=i % 2 == 0) for i in range(7)]
    assert first.add(fragments) == 7
    served = first.next_batch()
    assert served is not None and served.step == 0
    # A second process opening the file (the restarted actor) finds the queue and the step where they were.
    again = ReplayBuffer(batch_size=2, max_staleness=100, storage=url, starting_step=50)
    assert again.status()["queue_size"] == 5 and again.status()["current_step"] == 1
    rest = [again.next_batch() for _ in range(2)]
    assert [b.step for b in rest if b] == [1, 2] and again.next_batch() is None
    for original, back in zip(fragments[:6], served.items + [f for b in rest if b for f in b.items], strict=True):
        _assert_same(original, back)
    assert again.status()["queue_size"] == 1


def test_fragment_storage_factory_refuses_unknown_urls() -> None:
    with pytest.raises(ConfigError, match="unknown storage URL"):
        make_fragment_storage("redis://x")


def test_sqlite_storage_quarantines_a_damaged_fragment(tmp_path: Path) -> None:
    path = tmp_path / "replay.db"
    buffer = ReplayBuffer(batch_size=1, max_staleness=100, storage=f"sqlite:///{path}")
    buffer.add([_fragment(0)])
    buffer.add([_fragment(1)])
    with contextlib.closing(sqlite3.connect(path)) as db, db:  # the file is damaged behind the buffer's back
        db.execute("UPDATE items SET payload = x'00' WHERE gid = (SELECT min(gid) FROM items)")
    batch = buffer.next_batch()  # the damaged fragment is quarantined and counted; the next one is served
    assert batch is not None
    assert buffer.status()["storage"]["quarantined"] == 1
    assert buffer.next_batch() is None


def test_restarting_a_memory_buffer_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"max_restarts=-1 with storage='memory'.*sqlite"):
        start_replay_buffer(4, 1, storage="memory", max_restarts=-1)


def test_fleet_config_names_bad_placement_fields() -> None:
    with pytest.raises(ConfigError, match="placement is 'pack'"):
        FleetConfig(placement="pack")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"worker_resources.*'rollout': 0"):
        FleetConfig(worker_resources={"rollout": 0})
    with pytest.raises(ConfigError, match="n_workers is 0; a fleet needs at least 1 worker"):
        FleetConfig(n_workers=0)
