"""The run config: precedence (file < ROLLHUB_* < --set), printing, readable errors, the run directory."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from rollhub.experience import SampleFragment
from rollhub.run.config import CheckpointWeightsConfig, RunConfigError, load_config, read_toml
from rollhub.run.main import shipped_config
from rollhub.run.rundir import METRICS, RunDirectory
from rollhub.run.toml import dumps
from rollhub.train.ppo import PPOConfig, PPOLearner
from tests.run.run_process import CORRIDOR, rollhub_run


def test_precedence_file_then_environment_then_set(monkeypatch: pytest.MonkeyPatch) -> None:
    data = read_toml(CORRIDOR)
    assert load_config(data).trainer.lr == pytest.approx(3e-3)
    monkeypatch.setenv("ROLLHUB_TRAINER__LR", "0.01")
    monkeypatch.setenv("ROLLHUB_FLEET__WORKERS", "3")
    config = load_config(data, ["trainer.lr=0.02", "env.kwargs.length=7"])
    assert config.trainer.lr == pytest.approx(0.02) and config.fleet.workers == 3
    assert config.env.kwargs == {"length": 7, "max_steps": 30}  # tables merge key by key
    assert load_config(data).trainer.lr == pytest.approx(0.01)


def test_plug_points_pick_their_kind_and_default_to_the_first() -> None:
    config = load_config(read_toml(CORRIDOR), ["weights.kind=checkpoint", "weights.keep_last=2"])
    assert isinstance(config.weights, CheckpointWeightsConfig) and config.weights.keep_last == 2
    assert config.env.kind == "step" and config.trainer.kind == "ppo"  # the file names no kind


def test_printed_config_reads_back_as_the_same_config() -> None:
    config = load_config(shipped_config("cartpole"), ['trackers=[{kind="jsonl", path="m.jsonl"}]'])
    text = dumps(config.model_dump(mode="json"))
    assert load_config(tomllib.loads(text)) == config


def test_errors_name_every_key_path_and_what_to_do() -> None:
    sets = ["trainer.lrr=1", "writer.batch_size=0", "weights.kind=nfs", "env.kind=text"]
    with pytest.raises(RunConfigError) as caught:
        load_config(read_toml(CORRIDOR), sets, source="c.toml")
    lines = str(caught.value).splitlines()
    assert lines[0] == "c.toml is not a valid run config (4 problem(s)):"
    assert any(
        line.startswith("  trainer.lrr: unknown key; remove it or use one of anneal_steps, backend, clip,")
        for line in lines
    )
    batch = "  writer.batch_size: Input should be greater than or equal to 1 (got 0)"
    assert any(line.startswith(batch) for line in lines)
    assert "  weights.kind: unknown kind 'nfs'; use one of 'ray', 'checkpoint'" in lines
    assert "  env.kind: unknown kind 'text'; use one of 'step', 'group', 'external'" in lines
    with pytest.raises(RunConfigError, match=r"KEY\.PATH=VALUE"):
        load_config(read_toml(CORRIDOR), ["trainer.lr"])


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["fleet.env_processes=3", "fleet.envs_per_worker=2"], "  fleet.env_processes: 3 processes for"),
        (["fleet.fragments_per_version=3", "fleet.workers=2", "writer.batch_size=8"],
         "  fleet.fragments_per_version: 3 x 2 workers make fewer fragments per version than a batch"),
        (["writer.max_queued=4", "writer.batch_size=8"], "  writer.max_queued: 4 fragments can never make a batch"),
        (["writer.max_staleness=1"], "  fleet.fragments_per_version: pacing needs writer.max_staleness >= 2"),
    ],
)  # fmt: skip
def test_fleet_settings_that_cannot_work_together_are_refused(sets: list[str], expected: str) -> None:
    with pytest.raises(RunConfigError) as caught:
        load_config(shipped_config("cartpole"), sets)
    assert any(line.startswith(expected) for line in str(caught.value).splitlines()), str(caught.value)


def test_the_local_fleet_backend_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(RunConfigError) as caught:
        load_config(shipped_config("arithmetic"), ["fleet.backend='local'"])
    assert "  fleet.backend: 'local' runs step environments only (env.kind = 'group')" in str(caught.value)
    with pytest.raises(RunConfigError) as caught:
        load_config(shipped_config("arithmetic"), ["fleet.backend='processes'"])
    assert "  fleet.backend: 'processes' runs step environments only (env.kind = 'group')" in str(caught.value)
    with pytest.raises(RunConfigError) as caught:
        load_config(shipped_config("cartpole"), ["fleet.backend='cloud'"])
    assert "fleet.backend: Input should be 'ray', 'local' or 'processes'" in str(caught.value)
    assert load_config(shipped_config("cartpole"), ["fleet.backend='ray'"]).fleet.backend == "ray"
    assert load_config(shipped_config("cartpole"), ["fleet.backend='processes'"]).fleet.backend == "processes"


@pytest.mark.parametrize(
    ("sets", "names"),
    [
        (["fleet.workers=0"], "fleet.workers: Input should be greater than or equal to 1"),
        (["env.id='no_such_module_xyz:Env'"], "env.id: cannot import module 'no_such_module_xyz'"),
        (["env.kwargs.colour='red'"], "env: building 'tests.run.corridor:Corridor' with kwargs"),
    ],
)
def test_rollhub_run_refuses_a_bad_config_with_exit_2_and_starts_nothing(
    tmp_path: Path, sets: list[str], names: str
) -> None:
    run_dir = tmp_path / "run"
    args = [str(CORRIDOR), "--set", f"run.dir={str(run_dir)!r}"]
    done = rollhub_run(*args, *(part for s in sets for part in ("--set", s)), timeout_s=120)
    assert done.returncode == 2, done.stderr
    assert names in done.stderr and "Traceback" not in done.stderr
    assert not run_dir.exists()  # nothing written, nothing started


def test_rollhub_run_print_config_applies_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    done = rollhub_run("--print-config", str(CORRIDOR), "--set", "trainer.lr=5e-4", timeout_s=120)
    assert done.returncode == 0, done.stderr
    printed = tomllib.loads(done.stdout)
    assert printed["trainer"]["lr"] == 5e-4 and printed["env"]["id"] == "tests.run.corridor:Corridor"
    assert printed["writer"] == {"kind": "ray_replay", "batch_size": 4, "max_staleness": 1, "storage": "memory"}


def test_a_run_directory_holding_a_run_is_not_overwritten_by_default(tmp_path: Path) -> None:
    RunDirectory(tmp_path).append(METRICS, [{"version": 1}])
    done = rollhub_run(str(CORRIDOR), "--set", f"run.dir={str(tmp_path)!r}", timeout_s=120)
    assert done.returncode == 2 and f"--resume {tmp_path}" in done.stderr and "--overwrite" in done.stderr
    assert (tmp_path / METRICS).read_text() == '{"version": 1}\n'


def test_cut_keeps_complete_rows_and_drops_a_torn_line(tmp_path: Path) -> None:
    rundir = RunDirectory(tmp_path)
    rundir.append(METRICS, [{"version": v} for v in (1, 2, 3)])
    with open(tmp_path / METRICS, "a") as fh:
        fh.write('{"version": 4, "tru')  # a process killed mid-write
    assert rundir.read(METRICS) == [{"version": 1}, {"version": 2}, {"version": 3}]
    assert rundir.cut(METRICS, 2) == [{"version": 1}, {"version": 2}]
    assert (tmp_path / METRICS).read_text() == '{"version": 1}\n{"version": 2}\n'


def _fragments(rng: np.random.Generator, n: int = 4, length: int = 16) -> list[SampleFragment]:
    def one() -> SampleFragment:
        return SampleFragment(
            obs=rng.standard_normal((length, 3)).astype(np.float32), actions=rng.integers(0, 2, length),
            rewards=rng.standard_normal(length).astype(np.float32), terminated=np.zeros(length, bool),
            truncated=np.zeros(length, bool), logp=np.full(length, np.log(0.5), np.float32),
            values=np.zeros(length, np.float32), final_values=np.zeros(length, np.float32),
            bootstrap_obs=np.zeros(3, np.float32), bootstrap_value=0.0, state_in=None,
            versions=np.zeros(length, np.int64), episode_ids=np.zeros(length, np.int64),
        )  # fmt: skip

    return [one() for _ in range(n)]


def test_learner_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    """A restored learner continues exactly: same weights, optimizer moments and RNG, so the same next update."""
    data = _fragments(np.random.default_rng(0))
    learner = PPOLearner(3, 2, PPOConfig(seed=1))
    learner.update(data)
    rundir = RunDirectory(tmp_path)
    arrays, values = learner.state_dict()
    rundir.save_checkpoint(1, arrays, {"learner": values})
    resumed = rundir.latest_checkpoint()
    restored = PPOLearner(3, 2, PPOConfig(seed=99))
    restored.load_state_dict(resumed.arrays, resumed.values["learner"])
    torch_state = torch.get_rng_state()
    expected = learner.update(data)
    torch.set_rng_state(torch_state)
    assert restored.update(data) == expected
    for name, value in learner.weights().items():
        np.testing.assert_array_equal(restored.weights()[name], value)


def test_checkpoint_transport_fulfils_the_weight_protocols(tmp_path: Path) -> None:
    """The ``checkpoint`` weight transport: the publisher and subscriber speak WeightPublisher/WeightSubscriber."""
    from rollhub.weights import FanOutPublisher, WeightPublisher, WeightSubscriber
    from rollhub.weights.checkpoint import CheckpointDirectory, CheckpointPublisher, CheckpointSubscriber

    directory = CheckpointDirectory(tmp_path, keep_last=2)
    seen: list[int] = []

    class Recorder:
        def publish(self, version: int, weights: dict[str, np.ndarray]) -> None:
            seen.append(version)

    publisher = FanOutPublisher(Recorder(), CheckpointPublisher(directory))
    subscriber = CheckpointSubscriber(directory)
    assert isinstance(publisher, WeightPublisher) and isinstance(subscriber, WeightSubscriber)
    assert subscriber.loaded_version is None and subscriber.poll() is None
    for version in (0, 1, 2):
        publisher.publish(version, {"w": np.full(3, version, np.float32)})
    update = subscriber.poll()
    assert update is not None and update.version == 2 and subscriber.loaded_version == 2
    np.testing.assert_array_equal(update.weights["w"], np.full(3, 2, np.float32))
    assert subscriber.poll() is None and seen == [0, 1, 2] and directory.steps() == [1, 2]


def test_the_write_interval_reaches_the_workers_and_a_negative_one_is_refused() -> None:
    from rollhub.rollout.replay import ReplayBuffer
    from rollhub.run.assemble import step_fleet
    from rollhub.run.step_parts import probe_env

    config = load_config(read_toml(CORRIDOR), ["fleet.backend=local", "fleet.write_interval_s=0.5"])
    fleet = step_fleet(config, probe_env(config), ReplayBuffer(4, 2, in_process=True))
    try:
        assert fleet.config.worker.write_interval_s == 0.5
    finally:
        fleet.stop()
    with pytest.raises(RunConfigError, match=r"fleet\.write_interval_s: Input should be greater than or equal to 0"):
        load_config(read_toml(CORRIDOR), ["fleet.write_interval_s=-1"])


def test_step_threads_reach_the_managers_and_need_the_environments_in_the_worker() -> None:
    from rollhub.rollout.replay import ReplayBuffer
    from rollhub.run.assemble import step_fleet
    from rollhub.run.step_parts import probe_env

    keys = ["fleet.backend=local", "fleet.env_processes=0", "fleet.envs_per_worker=3", "fleet.step_threads=3"]
    config = load_config(read_toml(CORRIDOR), keys)
    fleet = step_fleet(config, probe_env(config), ReplayBuffer(4, 2, in_process=True))
    try:
        managers = [worker.manager for worker in fleet.workers()]
        assert managers and all(m.config.step_threads == 3 and len(m._threads.threads) == 3 for m in managers)
    finally:
        fleet.stop()
    with pytest.raises(RunConfigError, match=r"fleet\.step_threads: .*need fleet\.env_processes = 0 \(got None\)"):
        load_config(read_toml(CORRIDOR), ["fleet.step_threads=2"])
    with pytest.raises(RunConfigError, match=r"fleet\.step_threads: 5 threads for fleet\.envs_per_worker = 4 "):
        load_config(read_toml(CORRIDOR), ["fleet.env_processes=0", "fleet.envs_per_worker=4", "fleet.step_threads=5"])
    with pytest.raises(RunConfigError, match=r"fleet\.step_threads: Input should be a valid integer"):
        load_config(read_toml(CORRIDOR), ["fleet.env_processes=0", "fleet.step_threads=true"])
