"""Staged weight pushes against a fake engine: the engines load the staged copy, the durable checkpoint follows
in the background in order with the newest version winning, its errors surface, tmpfs keeps only the newest
versions and is emptied on close, and a restarted engine gets the newest version even before it is durable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from engine_fakes import healthy_server
from safetensors.torch import load_file

from rollhub.weights.checkpoint import CheckpointDirectory, CheckpointError
from rollhub.weights.engine import EngineWeightPublisher
from rollhub.weights.staging import StagedVersions, make_staging_root, sweep_stale

WAIT_S = 60.0


class Engine:
    """A fake engine that reads the file each ``reload_weights`` names, the moment it is asked."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, dict[str, Any]]] = []  # (weights_path, tensors)
        self.version = "default"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/collective_rpc":
            path = json.loads(request.content)["kwargs"]["weights_path"]
            tensors = load_file(Path(path) / "model.safetensors")  # copied out, as vLLM's reload does
            self.loaded.append((path, {name: t.clone() for name, t in tensors.items()}))
        if request.url.path == "/update_weight_version":
            self.version = json.loads(request.content)["new_version"]
        return httpx.Response(200, json={})


class GatedCheckpoints(CheckpointDirectory):
    """A durable directory whose copies wait on ``gate`` and fail for the versions in ``failing``."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, keep_last=5)
        self.gate = threading.Event()
        self.gate.set()
        self.started: list[int] = []
        self.failing: set[int] = set()

    def save_copy(self, step: int, source: str | os.PathLike[str]) -> Path:
        self.started.append(step)
        assert self.gate.wait(WAIT_S)
        if step in self.failing:
            raise OSError(28, "No space left on device")
        return super().save_copy(step, source)


def _until(done: Any) -> None:
    """Wait (up to a minute) until ``done()`` is true."""
    deadline = threading.Event()
    timer = threading.Timer(WAIT_S, deadline.set)
    timer.start()
    while not done():
        assert not deadline.wait(0.01), "timed out"
    timer.cancel()


def _weights(value: float) -> dict[str, Any]:
    return {"embed.weight": torch.full((8, 4), value, dtype=torch.bfloat16), "norm.weight": np.full(4, value, "f4")}


def _publisher(tmp_path: Path, engines: list[Engine], checkpoints: CheckpointDirectory | None = None,
               staged: bool = True) -> EngineWeightPublisher:  # fmt: skip
    def route(request: httpx.Request) -> httpx.Response:
        return engines[int(request.url.host[-1])](request)

    return EngineWeightPublisher(
        [f"http://engine{i}" for i in range(len(engines))],
        checkpoints or CheckpointDirectory(tmp_path / "durable", 3),
        transport=httpx.MockTransport(route),
        staging=tmp_path / "staging" if staged else None,
    )


def _value(tensors: dict[str, Any]) -> float:
    return float(tensors["embed.weight"].float()[0, 0])


def test_the_engine_loads_the_staged_copy_and_the_durable_checkpoint_follows(tmp_path: Path) -> None:
    engine = Engine()
    pub = _publisher(tmp_path, [engine])
    weights = _weights(1.5)
    pub.publish(1, weights)
    path, loaded = engine.loaded[0]
    assert Path(path).parent == (tmp_path / "staging").resolve() and engine.version == "1"
    assert loaded["embed.weight"].dtype == torch.bfloat16 and _value(loaded) == 1.5
    assert pub.timings[-1].staged
    weights["embed.weight"].fill_(9.0)  # the trainer changes its tensors right after the push
    assert pub.flush(WAIT_S)
    durable = pub.checkpoints.load(1, as_torch=True)
    assert _value(durable.tensors) == 1.5 and durable.tensors["norm.weight"].tolist() == [1.5] * 4
    pub.close()
    assert not (tmp_path / "staging").exists() and pub.checkpoints.steps() == [1]


def test_without_staging_the_engine_loads_the_durable_checkpoint(tmp_path: Path) -> None:
    engine = Engine()
    pub = _publisher(tmp_path, [engine], staged=False)
    pub.publish(1, _weights(1.0))
    assert Path(engine.loaded[0][0]) == pub.checkpoints.path(1).resolve() and not pub.timings[-1].staged
    pub.close()


def test_durable_writes_go_in_order_and_the_newest_waiting_version_wins(tmp_path: Path) -> None:
    engine = Engine()
    durable = GatedCheckpoints(tmp_path / "durable")
    durable.gate.clear()
    pub = _publisher(tmp_path, [engine], durable)
    pub.publish(1, _weights(1.0))
    _until(lambda: durable.started == [1])  # the writer is busy with 1
    for version in (2, 3, 4):
        pub.publish(version, _weights(float(version)))
    assert [p for p, _ in engine.loaded] == [str(pub.staged.path(v).resolve()) for v in (1, 2, 3, 4)]
    assert [_value(t) for _, t in engine.loaded] == [1.0, 2.0, 3.0, 4.0]
    durable.gate.set()
    assert pub.flush(WAIT_S)
    assert durable.started == [1, 4] and durable.steps() == [1, 4]  # 2 and 3 waited while 1 was written
    assert pub.durable.skipped == [2, 3]
    assert [_value(durable.load(v, as_torch=True).tensors) for v in (1, 4)] == [1.0, 4.0]
    pub.close()


def test_tmpfs_keeps_only_the_newest_version_and_reuses_retired_files(tmp_path: Path) -> None:
    engine = Engine()
    pub = _publisher(tmp_path, [engine])
    pub.publish(1, _weights(1.0))
    assert pub.flush(WAIT_S)
    first = os.stat(pub.staged.path(1) / "model.safetensors").st_ino
    pub.publish(2, _weights(2.0))
    assert pub.flush(WAIT_S)
    assert pub.staged.versions() == [2]  # 1 retired once 2 was there
    pub.publish(3, {"embed.weight": torch.full((2, 2), 3.0, dtype=torch.bfloat16)})  # smaller: the file shrinks
    assert os.stat(pub.staged.path(3) / "model.safetensors").st_ino == first  # version 1's file, overwritten
    assert set(engine.loaded[-1][1]) == {"embed.weight"} and _value(engine.loaded[-1][1]) == 3.0
    assert pub.flush(WAIT_S)
    assert _value(pub.checkpoints.load(3, as_torch=True).tensors) == 3.0
    for version in range(4, 8):
        pub.publish(version, _weights(float(version)))
    assert pub.flush(WAIT_S)
    entries = os.listdir(tmp_path / "staging")
    assert pub.staged.versions() == [7] and len(entries) <= 2, entries  # the newest, and one spare
    pub.close()
    assert not (tmp_path / "staging").exists()


def test_a_failed_durable_write_is_raised_at_the_next_push_once(tmp_path: Path) -> None:
    engine = Engine()
    durable = GatedCheckpoints(tmp_path / "durable")
    durable.failing = {1}
    pub = _publisher(tmp_path, [engine], durable)
    pub.publish(1, _weights(1.0))
    assert pub.durable.flush(WAIT_S)
    with pytest.raises(CheckpointError, match=r"durable copy of weight version 1 .* No space left on device"):
        pub.publish(2, _weights(2.0))
    assert engine.version == "1"  # the failed push did not reach the engine
    pub.publish(2, _weights(2.0))  # raised once: the run may go on
    assert pub.flush(WAIT_S) and durable.steps() == [2] and engine.version == "2"
    pub.close()


def test_a_failed_durable_write_is_raised_at_close_after_cleaning_up(tmp_path: Path) -> None:
    durable = GatedCheckpoints(tmp_path / "durable")
    durable.failing = {1}
    pub = _publisher(tmp_path, [Engine()], durable)
    pub.publish(1, _weights(1.0))
    with pytest.raises(CheckpointError, match="durable copy of weight version 1"):
        pub.close()
    assert not (tmp_path / "staging").exists()


def test_close_writes_the_version_still_waiting(tmp_path: Path) -> None:
    durable = GatedCheckpoints(tmp_path / "durable")
    durable.gate.clear()
    pub = _publisher(tmp_path, [Engine()], durable)
    pub.publish(1, _weights(1.0))
    _until(lambda: durable.started == [1])
    pub.publish(2, _weights(2.0))
    threading.Timer(0.2, durable.gate.set).start()
    pub.close()
    assert durable.steps() == [1, 2]


def test_a_restarted_engine_gets_the_newest_version_before_it_is_durable(tmp_path: Path) -> None:
    engines = [Engine(), Engine()]
    durable = GatedCheckpoints(tmp_path / "durable")
    pub = _publisher(tmp_path, engines, durable)
    pub.publish(1, _weights(1.0))
    assert pub.flush(WAIT_S)
    durable.gate.clear()
    pub.publish(2, _weights(2.0))
    _until(lambda: durable.started == [1, 2])
    pub.publish(3, _weights(3.0), skip={1})  # engine 1 is being restarted
    assert durable.steps() == [1]  # 2 is being written, 3 waits
    restarted = Engine()
    engines[1] = restarted
    assert pub.reload(1) == 3
    assert Path(restarted.loaded[0][0]) == pub.staged.path(3).resolve() and _value(restarted.loaded[0][1]) == 3.0
    durable.gate.set()
    assert pub.flush(WAIT_S) and durable.steps() == [1, 2, 3]
    pub.close()
    assert pub.newest() == (3, durable.path(3))  # staging gone: the durable checkpoint is the newest


def test_staged_versions_must_increase(tmp_path: Path) -> None:
    staged = StagedVersions(tmp_path / "s")
    staged.write(2, _weights(2.0))
    with pytest.raises(CheckpointError, match="not newer than the newest staged 2"):
        staged.write(2, _weights(2.0))


def test_staging_directories_of_dead_processes_are_swept(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"rollhub-push-{gone.stdout.strip()}-abc"
    dead.mkdir()
    mine = make_staging_root(tmp_path)
    assert not dead.exists() and mine.is_dir() and mine.name.startswith(f"rollhub-push-{os.getpid()}-")
    assert sweep_stale(tmp_path) == [] and mine.is_dir()  # this process is alive: its directory stays
    with pytest.raises(CheckpointError, match="not a writable directory"):
        make_staging_root(tmp_path / "missing")


def test_tied_names_are_the_aliases_of_an_earlier_parameter() -> None:
    from rollhub.run.llm import tied_names

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight
            self.norm = torch.nn.LayerNorm(3)

    assert tied_names(Tied()) == {"head.weight"}
    assert tied_names(torch.nn.Linear(2, 2)) == frozenset()


@pytest.mark.parametrize(("choice", "staged"), [("auto", False), ("none", False), ("shm", True)])
def test_push_staging_reaches_the_publisher_of_a_run_at_a_url(tmp_path: Path, choice: str, staged: bool) -> None:
    """``auto`` stages only for the engines the run starts (an engine at a URL may not share this machine's
    ``/dev/shm``); ``shm`` stages there for any engine, and the run's close deletes the directory."""
    from rollhub.run.assemble import engine_backend
    from rollhub.run.config import load_config
    from rollhub.run.rundir import RunDirectory

    if staged and not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm here")
    server = healthy_server()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    config = load_config({"env": {"kind": "group", "id": "mock"}, "policy": {"kind": "hf", "model": str(tmp_path)},
                          "inference": {"url": url, "push_staging": choice}})  # fmt: skip
    try:
        backend = engine_backend(config, RunDirectory(tmp_path / "run"), note=lambda _: None)
        root = backend.publisher.staged.root if backend.publisher.staged is not None else None
        try:
            assert (root is not None) == staged and backend.summary()["push_staging"] == staged
            if root is not None:
                assert root.parent == Path("/dev/shm") and root.name.startswith(f"rollhub-push-{os.getpid()}-")
            pushed: list[set[str]] = []
            backend.supervisor.publish = lambda version, arrays: pushed.append(set(arrays))  # type: ignore[method-assign]
            backend.tied = frozenset({"lm_head.weight"})
            backend.deliver(1, {"model.embed_tokens.weight": torch.zeros(2), "lm_head.weight": torch.zeros(2)})
            assert pushed == [{"model.embed_tokens.weight"}]  # the engine loads a tied head through the embedding
        finally:
            backend.close()
        assert root is None or not root.exists()
    finally:
        server.shutdown()
        server.server_close()


def test_a_bad_push_staging_is_refused_by_name() -> None:
    from rollhub.run.config import RunConfigError, load_config

    with pytest.raises(RunConfigError, match=r"inference.push_staging: Input should be 'auto', 'shm' or 'none'"):
        load_config({"env": {"kind": "group", "id": "mock"}, "policy": {"kind": "hf"},
                     "inference": {"push_staging": "ram"}})  # fmt: skip
    default = load_config({"env": {"kind": "group", "id": "mock"}, "policy": {"kind": "hf"}}).inference
    assert default.push_staging == "auto"


def test_shm_staging_without_dev_shm_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollhub.run.config import RunConfigError
    from rollhub.run.llm import EngineBackend

    monkeypatch.setattr("rollhub.weights.staging.SHM", tmp_path / "no-shm")
    backend = EngineBackend.__new__(EngineBackend)
    backend.inference = type("Inference", (), {"push_staging": "shm", "url": None})()  # type: ignore[assignment]
    with pytest.raises(RunConfigError, match=r"inference.push_staging: 'shm' needs a writable .*no-shm"):
        backend._staging_root()
    backend.inference.push_staging = "auto"  # type: ignore[misc]
    assert backend._staging_root() is None  # auto falls back to the durable checkpoint
