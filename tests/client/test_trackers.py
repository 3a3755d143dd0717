"""Trackers: the W&B tracker runs offline and writes its run under the names the server gave; the factory
and the JSON-lines tracker behave as documented."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollhub.client import EnvClient, JsonlTracker, NullTracker, TrackerUnavailable, WandbTracker, make_tracker
from rollhub.errors import ConfigError
from tests.client.conftest import CountingHandler, Running, start_trainer, wait_until
from tests.conftest import ServerProcess

HAS_WANDB = importlib.util.find_spec("wandb") is not None


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of an offline W&B run file (a ``:W&B`` header, then LevelDB-log records)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:  # block trailer padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_when_complete(path: Path) -> list[Any]:
    """The run file's records once its exit record is there (wandb's writer may still be flushing)."""
    records: list[Any] = []

    def complete() -> bool:
        try:
            records[:] = wandb_records(path)
        except Exception:  # a record still being written
            return False
        return any(r.WhichOneof("record_type") == "exit" for r in records)

    wait_until(complete, f"{path} to hold the whole run", timeout_s=60)
    return records


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is an optional extra (pip install 'rollhub[wandb]')")
def test_wandb_tracker_runs_offline_under_the_names_the_server_gave(
    rollhub_server: ServerProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    running: Callable[..., Running],
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    start_trainer(rollhub_server.url, wandb_group="grp", wandb_project="proj")
    # Another env named "toy" registered first, so the server names this handler's run "toy_1".
    assert EnvClient(rollhub_server.url).register_env(desired_name="toy", group_size=2, max_token_length=64)
    handler = CountingHandler(rollhub_server.url, tracker=WandbTracker(dir=tmp_path), off_policy_tolerance=50)
    stats = running(handler, max_groups=5).join(timeout_s=120)
    assert stats.groups_sent == 5 and handler.wandb_name == "toy_1"

    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, f"expected one offline run under {tmp_path}, found {runs}"
    records = read_when_complete(runs[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.display_name, run.run_group, run.project) == ("toy_1", "grp", "proj")
    logged = {
        item.key or "/".join(item.nested_key)
        for r in records
        if r.WhichOneof("record_type") == "history"
        for item in r.history.item
    }
    assert {"queue/size", "env/reward", "handler/groups_sent"} <= logged, logged
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config.get("env_id") == 1 and config.get("group_size") == 2


def test_wandb_tracker_without_wandb_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a)
    )
    with pytest.raises(TrackerUnavailable, match=r"rollhub\[wandb\]"):
        WandbTracker()
    with pytest.raises(TrackerUnavailable, match=r"rollhub\[wandb\]"):
        make_tracker("wandb")


def test_make_tracker_picks_by_name(tmp_path: Path) -> None:
    assert isinstance(make_tracker(None), NullTracker) and isinstance(make_tracker("none"), NullTracker)
    if HAS_WANDB:
        assert isinstance(make_tracker("wandb"), WandbTracker)
    jsonl = make_tracker(f"jsonl:{tmp_path / 'x.jsonl'}")
    assert isinstance(jsonl, JsonlTracker) and jsonl.path == tmp_path / "x.jsonl"
    mine = NullTracker()
    assert make_tracker(mine) is mine
    with pytest.raises(ConfigError, match="'tensorboard'"):
        make_tracker("tensorboard")


def test_jsonl_tracker_writes_init_metrics_and_finish(tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / "deep" / "run.jsonl"
    tracker = JsonlTracker(path)
    tracker.init(project="p", group="g", name="toy_3", config={"group_size": 4})
    tracker.log({"queue/size": np.int64(3), "env/score_mean": np.float32(0.5)})
    tracker.finish()
    tracker.log({"ignored": 1})  # after finish: nothing is written
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line.get("event") for line in lines] == ["init", None, "finish"]
    assert lines[0]["name"] == "toy_3" and lines[0]["config"] == {"group_size": 4}
    assert lines[1]["queue/size"] == 3 and lines[1]["env/score_mean"] == 0.5
