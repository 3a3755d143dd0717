"""The examples run as documented against ``rollhub serve``, and a handler process stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollhub.client import EnvClient
from tests.client.conftest import start_trainer, wait_until
from tests.conftest import ServerProcess


def _python(repo_root: Path, script: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{repo_root / 'src'}{os.pathsep}{repo_root}"}
    return subprocess.Popen(
        [sys.executable, str(repo_root / "examples" / script), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_toy_trainer_and_toy_handler_run_together(rollhub_server: ServerProcess, repo_root: Path) -> None:
    url = ["--server-url", rollhub_server.url]
    trainer = _python(repo_root, "toy_trainer.py", *url, "--steps", "5", "--batch-size", "8")
    handler = _python(repo_root, "toy_handler.py", *url, "--groups", "10", "--group-size", "4")
    handler_out, _ = handler.communicate(timeout=120)
    trainer_out, _ = trainer.communicate(timeout=120)
    assert handler.returncode == 0, handler_out
    assert trainer.returncode == 0, trainer_out
    assert "toy_addition_0: sent 10 groups (40 sequences)" in handler_out
    assert "step 5: 2 groups, 8 sequences" in trainer_out


def test_sigterm_finishes_the_group_in_hand_disconnects_and_exits(
    rollhub_server: ServerProcess, repo_root: Path, tmp_path: Path
) -> None:
    start_trainer(rollhub_server.url, batch_size=8)
    log = tmp_path / "toy.jsonl"
    handler = _python(
        repo_root,
        "toy_handler.py",
        "--server-url",
        rollhub_server.url,
        "--status-interval",
        "0.05",
        "--tracker",
        f"jsonl:{log}",
    )
    try:
        wait_until(lambda: log.exists() and "queue/size" in log.read_text(), "the handler to run")
        observer = EnvClient(rollhub_server.url)
        other = observer.register_env(desired_name="observer", group_size=4, max_token_length=8)
        assert other is not None
        assert observer.status_env(other.env_id).env_weight == pytest.approx(0.5)
        handler.send_signal(signal.SIGTERM)
        out, _ = handler.communicate(timeout=60)
    finally:
        if handler.poll() is None:
            handler.kill()
            handler.wait()
    assert handler.returncode == 0, out
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line.get("event") for line in lines[-2:]] == ["stop", "finish"]
    stop = lines[-2]
    assert stop["handler/groups_sent"] == stop["handler/groups_collected"] > 0, "the group in hand was sent"
    assert observer.status_env(other.env_id).env_weight == pytest.approx(1.0), "the handler disconnected"
