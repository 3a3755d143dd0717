"""The local and process fleets, and ``rollhub run`` on them, work where Ray cannot be imported at all.

Each check runs in a child process whose import path starts with a ``ray`` package that refuses to load (and
notes every attempt in a file), so an import of Ray anywhere, in the child or in a process it spawns (worker and
environment processes inherit the import path), fails the run or shows in that file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

BLOCKED_RAY = """\
import os
import traceback

with open(os.environ["ROLLHUB_RAY_ATTEMPTS"], "a") as log:
    log.write("".join(traceback.format_stack()) + "\\n")
raise ImportError("ray is made unimportable for this test")
"""

FLEETS = textwrap.dedent(
    """\
    import json
    import sys

    from rollout_fakes import WeightEchoPolicy, check_versions_as_loaded, drain_replay, publish_versions

    from rollhub.envs import EnvSpec
    from rollhub.rollout.backends.base import FleetConfig
    from rollhub.rollout.backends.local import LocalFleet, LocalWriter
    from rollhub.rollout.backends.processes import ProcessFleet
    from rollhub.rollout.replay import ReplayBuffer
    from rollhub.rollout.step.manager import StepManagerConfig, step_manager_factory
    from rollhub.rollout.worker import RolloutWorkerConfig

    SLEEP0 = EnvSpec("sleep", {"step_s": 0.0, "episode_length": 10})


    def run(fleet_class, env_processes):
        replay = ReplayBuffer(batch_size=1, max_staleness=1000, in_process=True)
        manager = StepManagerConfig(SLEEP0, n_envs=2, env_processes=env_processes, fragment_length=8)
        config = FleetConfig(n_workers=2, worker=RolloutWorkerConfig(1000, stats_every_s=0.01, drain_s=1.0))
        fleet = fleet_class(config, step_manager_factory(manager, WeightEchoPolicy), LocalWriter(replay))
        items = []
        try:
            publish_versions(fleet, replay, items, last=3)
        finally:
            infos = fleet.stop()
        items += drain_replay(replay)
        check_versions_as_loaded(items)
        return {
            "fragments": len(items),
            "workers": sorted({f.worker_id for f in items}),
            "episodes": len(fleet.statistics().history()),
            "node_ids": [info["node_id"] for info in infos],
            "buffer_node_id": replay.status()["node_id"],
        }


    if __name__ == "__main__":
        out = {"local": run(LocalFleet, 0), "processes": run(ProcessFleet, 1)}
        out["ray_imported"] = "ray" in sys.modules
        print(json.dumps(out))
    """
)


RUN_CONFIG = """\
[run]
name = "no-ray"
max_seconds = 240.0
max_updates = 3
progress = false

[env]
id = "tests.run.corridor:Corridor"
kwargs = { length = 5, max_steps = 30 }

[policy]
hidden = 8

[fleet]
workers = 2
envs_per_worker = 2
fragment_length = 16

[writer]
batch_size = 4
max_staleness = 1
"""


def _blocked_env(tmp_path: Path, *paths: Path) -> tuple[dict[str, str], Path]:
    """The environment of a child that cannot import Ray (and the file its attempts are noted in)."""
    shadow = tmp_path / "no-ray"
    (shadow / "ray").mkdir(parents=True)
    (shadow / "ray" / "__init__.py").write_text(BLOCKED_RAY)
    attempts = tmp_path / "ray-attempts.txt"
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join([str(shadow), *inherited, *map(str, paths)])
    return {**os.environ, "PYTHONPATH": path, "ROLLHUB_RAY_ATTEMPTS": str(attempts)}, attempts


def _attempts(attempts: Path) -> str:
    return attempts.read_text() if attempts.exists() else ""


def test_the_blocked_ray_package_does_block_ray(tmp_path: Path) -> None:
    env, attempts = _blocked_env(tmp_path)
    done = subprocess.run([sys.executable, "-c", "import ray"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "made unimportable" in done.stderr
    assert _attempts(attempts) != "", "the attempt was not noted"


def test_the_local_and_process_fleets_produce_fragments_and_episodes_without_ray(tmp_path: Path) -> None:
    script = tmp_path / "fleets.py"
    script.write_text(FLEETS)
    env, attempts = _blocked_env(tmp_path, HERE, REPO)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert _attempts(attempts) == "", "something tried to import ray:\n" + _attempts(attempts)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ray_imported"] is False
    for backend in ("local", "processes"):
        fleet = out[backend]
        assert fleet["fragments"] > 0 and fleet["workers"] == ["w0", "w1"], (backend, fleet)
        assert fleet["episodes"] > 0, (backend, fleet)
        assert fleet["node_ids"] == [None, None] and fleet["buffer_node_id"] is None, (backend, fleet)


def test_rollhub_run_on_the_local_and_process_fleets_imports_no_ray(tmp_path: Path) -> None:
    config = tmp_path / "corridor.toml"
    config.write_text(RUN_CONFIG)
    for backend in ("local", "processes"):
        env, attempts = _blocked_env(tmp_path / backend, REPO)
        run_dir = tmp_path / backend / "run"
        cmd = [sys.executable, "-m", "rollhub", "run", str(config), "--set", f"run.dir={str(run_dir)!r}",
               "--set", f"fleet.backend={backend!r}"]  # fmt: skip
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        assert _attempts(attempts) == "", f"rollhub run ({backend}) tried to import ray:\n" + _attempts(attempts)
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        assert summary["stop_reason"] == "update limit" and summary["policy_version"] == 3, summary
        assert summary["trained_steps"] > 0 and summary["env_steps"] > 0, summary  # the fleet fed the trainer
