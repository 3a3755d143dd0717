"""An unmodified Atropos ``BaseEnv`` (examples/atropos_env, atroposlib 0.4.0) trains the tiny model through a
trainer-only ``rollhub run``: the environment in ``serve`` mode (a subprocess) -> ``rollhub serve`` -> the
GRPO trainer, which pushes every version into the vLLM engine the environment samples from.

The groups reach the trainer exactly as the environment sent them (tokens, masks, scores, log-probs and
sampling settings, compared with what atroposlib itself wrote to ``data_path_to_save_groups``), stamped with a
version on arrival, and rollhub's held-out accuracy on the task rises by at least 0.5. A few minutes: the engine
starts (tens of seconds), the environment starts, then about 70 updates on two CPU cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")

from examples.atropos_env import run_demo

from rollhub.run.config import load_config, read_toml
from rollhub.run.main import execute
from rollhub.run.sources import ServerGroupSource
from rollhub.wire.group import group_to_item

pytestmark = pytest.mark.vllm
SENT_FIELDS = ("tokens", "masks", "scores", "inference_logprobs", "generation_params")


@pytest.fixture(scope="module")
def atroposlib_env() -> None:
    """atroposlib's BaseEnv imports (``make setup`` and ``make atropos-env``); skipped without them, except under
    ``make test`` (ROLLHUB_REQUIRE_VLLM=1)."""
    probe = [sys.executable, "-c", "import atroposlib.envs.base, examples.atropos_env.env"]
    done = subprocess.run(probe, env=run_demo.child_env(run_demo.atropos_path()), capture_output=True, text=True)
    if done.returncode != 0:
        if os.environ.get("ROLLHUB_REQUIRE_VLLM") == "1":
            pytest.fail(f"atroposlib's BaseEnv does not import (run make atropos-env): {done.stderr[-2000:]}")
        pytest.skip(f"atroposlib's BaseEnv does not import here ({done.stderr.strip().splitlines()[-1]})")


class Environment(threading.Thread):
    """Starts the example environment once the run wrote its endpoints; :meth:`stop` ends it."""

    def __init__(self, directory: Path) -> None:
        super().__init__(daemon=True)
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        self.done = threading.Event()

    def run(self) -> None:
        path = self.directory / "endpoints.json"
        while not path.exists() and not self.done.wait(0.2):
            pass
        if self.done.is_set():
            return
        command = run_demo.environment_command(json.loads(path.read_text()), self.directory, [])
        with open(self.directory / "env.log", "wb") as log:
            self.process = subprocess.Popen(command, cwd=run_demo.REPO, env=run_demo.child_env(run_demo.atropos_path()),
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def stop(self) -> None:
        self.done.set()
        self.join(30)
        if self.process is not None:
            run_demo.stop(self.process)


def plain(value: Any) -> Any:
    """``value`` with numpy arrays as lists (a served item holds arrays; a JSON line holds lists)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def sent_fields(item: dict[str, Any]) -> dict[str, Any]:
    """The fields the environment sent, exactly (floats compared as the float64 values sent)."""
    return {k: plain(item.get(k)) for k in SENT_FIELDS}


@pytest.mark.timeout(1800)  # an engine start, an environment start and about 70 updates, on a shared CPU
def test_an_unmodified_atropos_env_trains_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    vllm_python: str, atroposlib_env: None) -> None:  # fmt: skip
    received: list[dict[str, Any]] = []
    next_batch = ServerGroupSource.next_batch

    def recording(self: ServerGroupSource, wait_s: float) -> Any:
        groups = next_batch(self, wait_s)
        received.extend(group_to_item(g) for g in groups or [])
        return groups

    monkeypatch.setattr(ServerGroupSource, "next_batch", recording)
    directory = tmp_path / "run"
    # an engine on a busy shared CPU can take minutes to start: a generous ready timeout
    sets = [f"run.dir={json.dumps(str(directory))}", "run.progress=false", "run.max_seconds=1200",
            "run.max_updates=300", "eval.target_accuracy=0.7", f"inference.python={json.dumps(vllm_python)}",
            "inference.ready_timeout_s=900"]  # fmt: skip
    config = load_config(read_toml(run_demo.CONFIG), sets)
    environment = Environment(directory)
    environment.start()
    try:
        code = execute(config)
    finally:
        environment.stop()
    log = (directory / "env.log").read_text(errors="replace") if (directory / "env.log").exists() else "(no log)"
    summary = json.loads((directory / "summary.json").read_text())
    assert code == 0, (summary["stop_reason"], log[-3000:])
    assert summary["eval_accuracy"] >= summary["initial_eval_accuracy"] + 0.5, summary["curve"]
    assert summary["weight_pushes"] == summary["steps"] + 1  # version 0, then every update

    sent = [json.loads(line) for line in (directory / "env_groups.jsonl").read_text().splitlines()]
    assert len(received) >= summary["steps"] * config.trainer.groups_per_batch
    position = 0
    for item in received:  # every trained group is one the environment sent, unchanged, in the order it sent them
        while position < len(sent) and sent_fields(sent[position]) != sent_fields(item):
            position += 1
        assert position < len(sent), f"a group the environment never sent reached the trainer: {item}"
        position += 1
        assert isinstance(item["policy_version"], int)  # stamped by the server on arrival
    assert all(m == -100 for item in received for row in item["masks"] for m in row[:-1])  # prompt positions
    assert all(type(v) is float for item in received for row in plain(item["inference_logprobs"]) for v in row)
