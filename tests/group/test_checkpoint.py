from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from rollhub.weights.checkpoint import (
    CheckpointDirectory,
    CheckpointError,
    CheckpointPublisher,
    CheckpointSubscriber,
)


def _state(step: int, size: int = 4) -> dict[str, np.ndarray]:
    return {"w": np.full((size, size), step, dtype=np.float32), "b": np.arange(size, dtype=np.int64) + step}


def test_round_trip_keeps_values_dtypes_and_metadata(tmp_path: Path) -> None:
    d = CheckpointDirectory(tmp_path)
    d.save(3, {"w": torch.randn(3, 2), "n": np.arange(5, dtype=np.int32)}, {"lesson": "add", "lr": 0.001})
    ckpt = d.load(3)
    assert ckpt.step == 3 and ckpt.metadata == {"lesson": "add", "lr": 0.001}
    assert ckpt.tensors["w"].dtype == np.float32 and ckpt.tensors["n"].dtype == np.int32
    np.testing.assert_array_equal(ckpt.tensors["n"], np.arange(5))


def test_torch_model_round_trip(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    d = CheckpointDirectory(tmp_path)
    d.save(0, model.state_dict())
    other = torch.nn.Linear(4, 3)
    other.load_state_dict({k: torch.from_numpy(v) for k, v in d.load_latest().tensors.items()})
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def test_torch_tensors_of_any_dtype_keep_it(tmp_path: Path) -> None:
    """bfloat16 (which numpy has no type for) is stored as bfloat16 and comes back as a torch tensor; the dtypes
    numpy has come back as numpy arrays, or everything as torch tensors with as_torch."""
    w = torch.randn(3, 2).to(torch.bfloat16)
    d = CheckpointDirectory(tmp_path)
    d.save(1, {"w": w, "h": torch.randn(2).half(), "n": np.arange(3, dtype=np.int32), "i": torch.arange(2)})
    ckpt = d.load(1)
    assert isinstance(ckpt.tensors["w"], torch.Tensor) and torch.equal(ckpt.tensors["w"], w)
    assert ckpt.tensors["h"].dtype == np.float16 and ckpt.tensors["i"].dtype == np.int64
    np.testing.assert_array_equal(ckpt.tensors["n"], np.arange(3))
    as_torch = d.load_latest(as_torch=True).tensors
    assert {k: v.dtype for k, v in as_torch.items()} == {
        "w": torch.bfloat16, "h": torch.float16, "n": torch.int32, "i": torch.int64
    }  # fmt: skip
    d.save(2, _state(2))  # numpy only, as before
    assert isinstance(d.load(2, as_torch=True).tensors["w"], torch.Tensor)


def test_tensors_that_share_memory_are_saved_apart(tmp_path: Path) -> None:
    tied = torch.randn(4, 3).to(torch.bfloat16)  # tied embeddings: two names, one storage
    d = CheckpointDirectory(tmp_path)
    d.save(0, {"embed": tied, "head": tied, "row": tied[1]})
    got = d.load(0).tensors
    assert torch.equal(got["embed"], tied) and torch.equal(got["head"], tied) and torch.equal(got["row"], tied[1])


def test_keeps_the_last_n_and_leaves_no_temporaries(tmp_path: Path) -> None:
    d = CheckpointDirectory(tmp_path, keep_last=2)
    for step in range(5):
        d.save(step, _state(step))
    assert d.steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_00000003", "step_00000004"]
    assert (tmp_path / "LATEST").read_text() == "4"
    assert d.load_latest().step == 4


def test_errors_name_the_problem(tmp_path: Path) -> None:
    d = CheckpointDirectory(tmp_path, keep_last=1)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        d.load_latest()
    d.save(1, _state(1))
    with pytest.raises(CheckpointError, match="already exists"):
        d.save(1, _state(1))
    d.save(2, _state(2))
    with pytest.raises(CheckpointError, match=r"step 1 .*pruned"):
        d.load(1)
    (d.path(2) / "model.safetensors").write_bytes(b"garbage!")
    with pytest.raises(CheckpointError, match="unreadable"):
        d.load(2)
    with pytest.raises(CheckpointError, match="keep_last"):
        CheckpointDirectory(tmp_path, keep_last=0)


def test_subscriber_sees_each_new_checkpoint_once(tmp_path: Path) -> None:
    d = CheckpointDirectory(tmp_path)
    pub, sub = CheckpointPublisher(d), CheckpointSubscriber(CheckpointDirectory(tmp_path))
    assert sub.poll() is None
    pub.publish(1, _state(1))
    got = sub.poll()
    assert got is not None and got.step == 1
    assert sub.poll() is None
    pub.publish(2, _state(2))
    pub.publish(3, _state(3))
    got = sub.poll()
    assert got is not None and got.step == 3  # skips straight to the newest


def test_reader_racing_a_writer_never_sees_a_partial_checkpoint(tmp_path: Path) -> None:
    """A writer saves big checkpoints while pruning to 2; a reader loads continuously and checks every one."""
    size = 256  # 256 KiB per tensor, so writes take long enough to overlap reads
    d = CheckpointDirectory(tmp_path, keep_last=2)
    done = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for step in range(60):
                d.save(step, _state(step, size), {"step": step})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    writer = threading.Thread(target=write)
    writer.start()
    reader = CheckpointDirectory(tmp_path, keep_last=2)
    loads, last = 0, -1
    while True:
        finished = done.is_set()  # read before loading, so the final checkpoint is loaded too
        try:
            ckpt = reader.load_latest()
        except CheckpointError as exc:
            assert "no checkpoint in" in str(exc)  # only before the first save
            assert last == -1
            continue
        s = ckpt.step
        assert ckpt.metadata == {"step": s}
        assert ckpt.tensors["w"].shape == (size, size) and (ckpt.tensors["w"] == s).all()
        np.testing.assert_array_equal(ckpt.tensors["b"], np.arange(size) + s)
        assert s >= last
        last, loads = s, loads + 1
        if finished:
            break
    writer.join()
    assert not errors and last == 59 and loads > 1


def test_the_written_file_is_safetensors_and_an_overwrite_in_place_shrinks_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from rollhub.weights.checkpoint import write_safetensors

    embed = torch.randn(6, 4).to(torch.bfloat16)
    big = {"embed": embed, "head": embed, "scalar": torch.tensor(3.0), "empty": torch.zeros(0, 2),
           "flags": np.array([True, False]), "be": np.arange(3, dtype=">i4"),
           "strided": torch.randn(4, 6).T}  # fmt: skip
    path = tmp_path / "model.safetensors"
    size = write_safetensors(path, big, {"step": "1", "metadata": "{}"})
    assert path.stat().st_size == size
    loaded = load_file(path)
    for name, value in big.items():
        expect = (
            torch.as_tensor(value.astype(value.dtype.newbyteorder("="))) if isinstance(value, np.ndarray) else value
        )
        assert torch.equal(loaded[name], expect) and loaded[name].dtype == expect.dtype, name
    write_safetensors(path, {"scalar": torch.tensor(4.0)}, {"step": "2", "metadata": "{}"}, fsync=False)
    assert set(load_file(path)) == {"scalar"} and path.stat().st_size < size
    with pytest.raises(CheckpointError, match=r"'odd' has dtype torch\.complex64"):
        write_safetensors(path, {"odd": torch.zeros(2, dtype=torch.complex64)}, {})


def test_save_copy_takes_a_checkpoint_of_the_same_step_only(tmp_path: Path) -> None:
    fast = CheckpointDirectory(tmp_path / "fast", durable=False)
    durable = CheckpointDirectory(tmp_path / "durable")
    source = fast.save(3, {"w": np.arange(4, dtype=np.float32)}) / "model.safetensors"
    with pytest.raises(CheckpointError, match="holds step 3, not 4"):
        durable.save_copy(4, source)
    durable.save_copy(3, source)
    assert durable.steps() == [3] and durable.load(3).tensors["w"].tolist() == [0, 1, 2, 3]
    (tmp_path / "junk").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CheckpointError, match="is not a rollhub checkpoint"):
        durable.save_copy(5, tmp_path / "junk")
