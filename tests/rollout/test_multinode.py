"""The fleet and the replay buffer on a multi-node Ray cluster (a head and worker nodes on this machine), losing a node.

Each test runs ``multinode_cluster.py`` in a session of its own: a multi-node cluster cannot share a process with
the test session's local Ray runtime, and whatever is left in that session afterwards is killed, so no Ray process
outlives a test, even a failed one. Ray's address file and sockets go to a private ``RAY_TMPDIR``, so other Ray
users on the machine never see this cluster. The script records what happened; the assertions are here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rollout_fakes

import rollhub

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).with_name("multinode_cluster.py")
SCENARIO_S = 800.0  # the script's own phases wait at most 240 s each


def _kill_leftovers(sid: int) -> list[int]:
    """Wait briefly for the scenario's session to empty, then kill what is left in it; returns those pids."""
    deadline = time.monotonic() + 30
    while (left := rollout_fakes.session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    rollout_fakes.kill_all(left)
    return left


def run_scenario(name: str, tmp_path: Path, fail_node_starts: int = 0) -> dict[str, Any]:
    """Run one scenario to completion and return what it recorded; fail with its log when it did not finish.
    ``fail_node_starts``: how many node starts the script fails on purpose (it retries a failed start)."""
    ray_tmp = tempfile.mkdtemp(prefix="rh-mn-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    src = str(Path(rollhub.__file__).parents[1])  # the rollhub under test, also for the cluster's workers
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    env["FAIL_NODE_STARTS"] = str(fail_node_starts)
    env.pop("RAY_ADDRESS", None)
    out, log_path = tmp_path / "result.json", tmp_path / "scenario.log"
    command = [sys.executable, str(SCRIPT), name, str(out), str(tmp_path)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=log, env=env, cwd=tmp_path, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=SCENARIO_S)
        except subprocess.TimeoutExpired:
            rc = None
            proc.kill()
        finally:
            proc.wait()
            left = _kill_leftovers(proc.pid)  # start_new_session: the session id is the script's pid
            shutil.rmtree(ray_tmp, ignore_errors=True)
    text = log_path.read_text(errors="replace")
    assert rc == 0, f"scenario {name} {'timed out' if rc is None else f'exited with {rc}'}; log tail:\n{text[-8000:]}"
    assert not left, f"processes {left} outlived the cluster's shutdown"
    return json.loads(out.read_text())


def _served_by(result: dict[str, Any]) -> Counter[str]:
    return Counter(s["worker"] for s in result["served"])


def test_fleet_spreads_over_nodes_and_replaces_the_workers_of_a_lost_node(tmp_path: Path) -> None:
    # The first node start (the head's) fails on purpose: the script starts over on a fresh cluster, and nothing of
    # the failed start is left running (run_scenario checks the session is empty after the shutdown).
    result = run_scenario("fleet", tmp_path, fail_node_starts=1)
    assert "injected failure 1" in result["failed_starts"]
    before, victim = result["nodes_before"], result["victim"]
    assert before["w0"] != before["w1"], "the two workers run on different nodes"
    assert set(before.values()) == set(result["worker_nodes"]), "no worker on the head node (it offers no rollout)"
    survivor = next(n for n in result["worker_nodes"] if n != victim)

    status = result["fleet_status"]
    assert status["restarts"] == [0, 1], status["events"]
    assert any("slot 1" in e and "node has died" in e and "restarted" in e for e in status["events"]), status["events"]
    assert {w["node_id"] for w in status["workers"]} == {survivor}, "the replacement runs on the surviving node"
    assert {w["state"] for w in status["workers"]} == {"running"}

    mark = result["served_before_removal_mark"]
    after = result["served"][mark:]
    replacement = [s for s in after if s["worker"].startswith("w1r")]
    assert len(replacement) >= 5 and sum(s["worker"] == "w0" for s in after) >= 5, "the trainer keeps receiving"
    assert min(s["min_version"] for s in replacement) >= result["version_at_removal"], "it starts on the newest weights"

    # Nothing acknowledged is lost: every fragment the buffer took reached the trainer once, and every write a live
    # worker saw acknowledged is among them.
    keys = [s["key"] for s in result["served"]]
    assert len(keys) == len(set(keys)) == result["replay_status"]["added"]
    served_by = _served_by(result)
    assert [w["worker_id"] for w in result["final_workers"]] == ["w0", "w1r1"]
    for worker in result["final_workers"]:  # items_unsent (refused by a full buffer at stop) were never acknowledged
        assert worker["state"] == "stopped"
        assert served_by[worker["worker_id"]] == worker["items_sent"], worker["worker_id"]


def test_sqlite_replay_buffer_restarts_on_another_node_with_everything_it_acknowledged(tmp_path: Path) -> None:
    result = run_scenario("replay", tmp_path)
    assert result["status_before"]["node_id"] == result["home_node"]
    assert result["status_after"]["node_id"] == result["other_node"], "Ray restarted the buffer on the survivor"
    # Nobody consumed between these two readings: the restarted buffer read its step and queue from the file (the
    # worker may have added more meanwhile, so the queue can only have grown).
    at_removal, after = result["queued_at_removal"], result["status_after"]
    assert after["current_step"] == at_removal["current_step"] and after["queue_size"] >= at_removal["queue_size"]

    # The fragments acknowledged while nobody consumed (the probes) are served after the restart, each once.
    mark = result["served_before_removal_mark"]
    served_after = [s["key"] for s in result["served"][mark:]]
    assert all(served_after.count(p) == 1 for p in result["probes"])
    assert not set(result["probes"]) & {s["key"] for s in result["served"][:mark]}

    # The step counter continues across the restart: no step is served twice or skipped.
    steps = [s["step"] for s in result["served"]]
    assert steps == list(range(steps[0], steps[0] + len(steps)))

    # Every write the worker saw acknowledged, before, during and after the buffer's restart, reached the trainer
    # (an add in flight when the buffer died is retried, so it may land twice; then it is served twice).
    (worker,) = result["final_workers"]
    assert result["fleet_status"]["restarts"] == [0], "the worker on the other node kept running"
    assert worker["state"] == "stopped" and worker["items_unsent"] == 0
    worker_keys = {s["key"] for s in result["served"] if s["worker"] == worker["worker_id"]}
    assert len(worker_keys) == worker["items_sent"] > 0


def test_ppo_keeps_learning_when_a_node_is_lost(tmp_path: Path) -> None:
    result = run_scenario("learn", tmp_path)
    before, victim = result["nodes_before"], result["victim"]
    assert before["w0"] != before["w1"]
    status = result["fleet_status"]
    assert status["restarts"] == [0, 1] and any("node has died" in e for e in status["events"]), status["events"]
    assert victim == before["w1"] and {w["node_id"] for w in status["workers"]} == {before["w0"]}, "all on the survivor"
    assert any(any(w.startswith("w1r") for w in workers) for workers in result["batch_workers"][16:])
    returns = result["returns"]
    first, last = float(np.mean(returns[:20])), float(np.mean(returns[-20:]))
    assert last > max(2 * first, 100), (first, last)
