"""The tutorial's steps as a user takes them: a package of their own beside a config, ``rollhub run`` with no
``PYTHONPATH`` naming it, from the package's directory or from anywhere else with the config's path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rollhub

# rollhub itself is importable (installed, or this checkout's src); the user's package is not
ROLLHUB_ONLY = {**os.environ, "PYTHONPATH": str(Path(rollhub.__file__).resolve().parents[1])}

CORRIDOR = '''
import numpy as np


class Corridor:
    """Walk right to the last cell (+1); every step costs 0.1; cut after max_steps."""

    action_space_n = 2

    def __init__(self, length=4, max_steps=20):
        self.length, self.max_steps = length, max_steps

    def reset(self, *, seed=None):
        self.pos = self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.pos = min(max(self.pos + (1 if int(action) == 1 else -1), 0), self.length - 1)
        self.t += 1
        done = self.pos == self.length - 1
        return self._obs(), float(done) - 0.1, done, not done and self.t >= self.max_steps, {}

    def _obs(self):
        obs = np.zeros(self.length, np.float32)
        obs[self.pos] = 1.0
        return obs

    def close(self):
        pass
'''

# the ten-line bandit of the tutorial: no close(), which is optional
BANDIT = """
import numpy as np


class TwoArm:
    action_space_n = 2

    def reset(self, *, seed=None):
        self.rng = np.random.default_rng(seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        reward = float(self.rng.random() < (0.8 if int(action) == 1 else 0.2))
        return np.zeros(1, np.float32), reward, True, False, {}
"""

NO_STEP = """
class Lazy:
    action_space_n = 2

    def reset(self, *, seed=None):
        return [0.0], {}
"""


def write_project(root: Path, env_id: str, backend: str = "local") -> Path:
    """``root/mypkg/`` (the environments) and ``root/run.toml`` naming ``env_id``, with tiny limits."""
    package = root / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, source in (("corridor", CORRIDOR), ("bandit", BANDIT), ("lazy", NO_STEP)):
        (package / f"{name}.py").write_text(textwrap.dedent(source))
    config = root / "run.toml"
    config.write_text(
        textwrap.dedent(f"""
        [run]
        name = "mine"
        dir = "runs/mine"
        max_seconds = 240.0
        max_updates = 3
        progress = false

        [env]
        id = "{env_id}"

        [fleet]
        backend = "{backend}"
        workers = 1
        envs_per_worker = 2
        fragment_length = 16

        [writer]
        batch_size = 2
        """)
    )
    return config


def rollhub_run(*args: str, cwd: Path, timeout_s: float = 240.0) -> subprocess.CompletedProcess[str]:
    """``rollhub run ARGS`` from ``cwd``; ``-P``: as the console script, the directory is not on the path."""
    cmd = [sys.executable, "-P", "-m", "rollhub", "run", *args]
    return subprocess.run(cmd, cwd=cwd, env=ROLLHUB_ONLY, capture_output=True, text=True, timeout=timeout_s)


def finished(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["policy_version"] == 3 and summary["stop_reason"] == "update limit"
    return summary


def test_a_package_beside_the_config_runs_from_its_directory_in_worker_processes(tmp_path: Path) -> None:
    write_project(tmp_path, "mypkg.corridor:Corridor", backend="processes")
    # the user's directory is searched after the installed packages, in every process: this never loads
    (tmp_path / "numpy.py").write_text("raise ImportError('the directory shadowed an installed package')\n")
    finished(rollhub_run("run.toml", cwd=tmp_path))
    assert (tmp_path / "runs" / "mine" / "metrics.jsonl").exists()  # run.dir is relative to the directory


def test_an_env_without_close_runs_from_another_directory_in_environment_processes(tmp_path: Path) -> None:
    config = write_project(tmp_path / "project", "mypkg.bandit:TwoArm")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    finished(rollhub_run(str(config), "--set", "fleet.env_processes=2", cwd=elsewhere))
    finished(rollhub_run(str(config), "--set", "fleet.env_processes=0", "--overwrite", cwd=elsewhere))


@pytest.mark.ray
def test_a_package_beside_the_config_reaches_ray_workers(tmp_path: Path) -> None:
    config = write_project(tmp_path / "project", "mypkg.bandit:TwoArm", backend="ray")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    finished(rollhub_run(str(config), cwd=elsewhere))


@pytest.mark.parametrize(
    ("env_id", "says"),
    [
        ("mypkg.lazy:Lazy", "env.id: env 'mypkg.lazy:Lazy' built Lazy, which has no step() method"),
        ("otherpkg.envs:Corridor", "No module named 'otherpkg'; make it importable: put the package beside the config"),
    ],
)
def test_an_env_that_cannot_run_is_refused_with_exit_2_naming_what_is_missing(
    tmp_path: Path, env_id: str, says: str
) -> None:
    config = write_project(tmp_path, env_id)
    done = rollhub_run(str(config), cwd=tmp_path)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "pip install -e" in done.stderr or "otherpkg" not in env_id
    assert "Traceback" not in done.stderr and not (tmp_path / "runs").exists()
