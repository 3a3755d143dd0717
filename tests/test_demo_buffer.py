"""``rollhub demo buffer`` end to end: server, handlers and trainer over HTTP, with a JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_buffer_moves_data_through_the_server(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "rollhub", "demo", "buffer", "--max-seconds", "4", "--summary-json", str(summary_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == summary
    assert summary["batches_out"] > 0 and summary["steps"] == summary["batches_out"]
    assert summary["sequences_out"] == 32 * summary["batches_out"]
    # every sequence served was sent by a handler: 8 per group
    assert summary["groups_in"] * 8 >= summary["sequences_out"]
