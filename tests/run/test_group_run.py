"""``rollhub run`` on the group path: a user-defined GroupEnv learns, bad combinations are refused before
anything starts, the effective config prints, and a resumed run continues the trainer and its records."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rollhub.curriculum import LessonDependency
from rollhub.run.config import RunConfigError, load_config, read_toml
from rollhub.run.group_parts import build_policy, model_shape, probe_group_env
from rollhub.run.main import main
from rollhub.run.rundir import RunDirectory
from tests.run.echo_digit import EchoDigit
from tests.run.run_process import REPO, rollhub_run, rows, summary_of

ECHO = REPO / "tests" / "run" / "echo_digit.toml"


def untrained_baseline(seed: int = 0) -> tuple[float, float]:
    """Greedy accuracy over the ten digits and mean sampled reward of the config's policy before training."""
    policy = build_policy(model_shape(load_config(read_toml(ECHO)).policy), seed)
    env = EchoDigit()
    _, evaluation = env.sample(policy, 10, 1, "eval", np.random.default_rng(0))
    _, training = env.sample(policy, 64, 8, "train", np.random.default_rng(1))
    return evaluation["accuracy"], training["mean_reward"]


def test_run_learns_a_user_defined_group_environment(tmp_path: Path) -> None:
    """The digit-echo task from scratch: the run reaches its held-out target (0.9) within 200 updates, at least
    0.5 above the untrained policy's accuracy measured here, and the final checkpoint's weights score the
    reported accuracy when evaluated here."""
    baseline_accuracy, baseline_reward = untrained_baseline()
    assert baseline_accuracy <= 0.2  # a random policy rarely answers "d<eos>"
    done = rollhub_run(str(ECHO), "--set", f"run.dir={str(tmp_path / 'run')!r}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = summary_of(done)
    assert summary["stop_reason"] == "target reached" and summary["steps"] <= 200
    assert summary["eval_accuracy"] >= max(0.9, baseline_accuracy + 0.5)
    assert summary["train_reward_last10"] >= baseline_reward + 0.3
    assert summary["variant"] == "in-process" and summary["max_group_staleness"] <= 2
    correction = summary["correction"]
    assert (correction["preset"], correction["dual_clip"]) == ("tis", 3.0)  # the documented default
    assert 0 < correction["ess_fraction_median"] <= 1 and 0 <= correction["capped_fraction_mean"] <= 1
    assert correction["masked_fraction_mean"] == 0.0 and correction["outside_support_fraction_mean"] == 0.0

    run = RunDirectory(tmp_path / "run")
    ckpt = run.checkpoints.load_latest()
    assert ckpt.step == summary["steps"] and ckpt.metadata["trainer"]["version"] == summary["steps"]
    policy = build_policy(model_shape(load_config(read_toml(ECHO)).policy), 0)
    policy.model.load_state_dict(
        {k.removeprefix("model."): torch.from_numpy(v) for k, v in ckpt.tensors.items() if k.startswith("model.")}
    )
    _, evaluation = EchoDigit().sample(policy, 10, 1, "eval", np.random.default_rng(0))
    assert evaluation["accuracy"] == pytest.approx(summary["eval_accuracy"])
    metrics = rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["version"] for r in metrics] == list(range(1, summary["steps"] + 1))
    # the staleness of what each update trained on, as the learning curve's lower panel draws it
    assert max(r["staleness"] for r in metrics) == summary["max_group_staleness"]
    assert all(r["mean_staleness"] <= r["staleness"] for r in metrics)


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (['trainer.kind="ppo"'], "trainer.kind: 'ppo' does not go with env.kind = 'group'; use 'grpo'"),
        (['writer.kind="ray_replay"'], "writer.kind: 'ray_replay' does not go with env.kind = 'group'"),
        (["run.target_return=1.0"], "run.target_return: a group run has no episodes; use eval.target_accuracy"),
        (['env.id="tests.run.echo_digit:Nope"'], "env: module 'tests.run.echo_digit' has no 'Nope'"),
        (["policy.d_model=30"], "policy.d_model: 30 is not a multiple of policy.n_heads"),
    ],
)
def test_bad_group_configs_exit_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sets: list[str], key: str
) -> None:
    run_dir = tmp_path / "run"
    args = [str(ECHO), "--set", f"run.dir={str(run_dir)!r}"]
    for assignment in sets:
        args += ["--set", assignment]
    assert main(args) == 2
    assert key in capsys.readouterr().err
    assert not run_dir.exists()  # nothing started


def test_a_step_environment_with_group_kinds_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    corridor = str(REPO / "tests" / "run" / "corridor.toml")
    assert main([corridor, "--print-config", "--set", 'writer.kind="server"']) == 2
    assert "writer.kind: 'server' does not go with env.kind = 'step'; use 'ray_replay'" in capsys.readouterr().err


def test_print_config_gives_the_group_kinds_and_reads_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Tables that name no kind default to the group kinds; the printed TOML is the same config again."""
    minimal = tmp_path / "minimal.toml"
    minimal.write_text('[env]\nkind = "group"\nid = "tests.run.echo_digit:EchoDigit"\n')
    assert main([str(minimal), "--print-config"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "printed.toml").write_text(printed)
    config = load_config(read_toml(tmp_path / "printed.toml"))
    assert (config.policy.kind, config.writer.kind, config.trainer.kind) == ("transformer", "in_process", "grpo")
    assert config == load_config(read_toml(minimal))


def test_resume_continues_the_trainer_the_records_and_the_curriculum(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    first = [str(ECHO), "--set", f"run.dir={str(run_dir)!r}", "--set", "run.max_updates=20"]
    assert main([*first, "--set", "eval.target_accuracy=1.1", "--set", "run.checkpoint_every=10"]) == 1
    before = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert before["steps"] == 20 and before["stop_reason"] == "update limit"
    saved = RunDirectory(run_dir).checkpoints.load_latest()
    assert saved.metadata["curriculum"]["lessons"]["main"]["n_samples"] > 0

    assert main(["--resume", str(run_dir), "--set", "run.max_updates=40"]) == 1
    after = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert after["steps"] == 40 and [s for s, _ in after["curve"]] == [0, 10, 20, 30, 40]
    assert after["curve"][:3] == before["curve"]
    assert [r["version"] for r in rows(run_dir / "metrics.jsonl")] == list(range(1, 41))
    resumed = RunDirectory(run_dir).checkpoints.load_latest()
    assert resumed.metadata["trainer"]["version"] == 40 and resumed.metadata["sessions"] == 2
    assert (
        resumed.metadata["curriculum"]["lessons"]["main"]["n_samples"]
        > saved.metadata["curriculum"]["lessons"]["main"]["n_samples"]
    )
    assert any(k.startswith("optim.") for k in resumed.tensors)


def test_curriculum_lessons_lay_their_kwargs_over_the_env_and_a_cycle_is_a_config_error() -> None:
    lessons = [
        {"id": "low", "kwargs": {"digits": "01234"}, "threshold": 0.6},
        {"id": "high", "kwargs": {"digits": "56789"}, "depends_on": ["low"], "graduate_threshold": 0.9},
    ]
    data = {**read_toml(ECHO), "curriculum": {"lessons": lessons, "eval_every": 5}}
    curriculum = probe_group_env(load_config(data))
    low, high = curriculum.lessons
    assert (low.lesson_id, low.env_spec, low.env_args) == ("low", "tests.run.echo_digit:EchoDigit", {"digits": "01234"})
    assert high.dependencies == (LessonDependency("low", 0.6),) and high.graduate_threshold == 0.9
    assert (high.n_examples, high.n_generations, curriculum.eval_frequency) == (16, 8, 5)
    lessons[0]["depends_on"] = ["high"]
    with pytest.raises(RunConfigError, match=r"curriculum\.lessons: lesson dependencies form a cycle"):
        probe_group_env(load_config(data))
    lessons[0] = {"id": "low", "kwargs": {"no_such_argument": 1}}
    with pytest.raises(RunConfigError, match=r"curriculum\.lessons\[0\]: environment .* rejected arguments"):
        probe_group_env(load_config({**data, "curriculum": {"lessons": lessons}}))
