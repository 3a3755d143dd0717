"""PPO options: lr and clip schedules, minibatch size or count, value clipping, their [trainer] keys, resume."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from rollhub.experience import SampleFragment
from rollhub.run.assemble import ppo_learner
from rollhub.run.config import RunConfigError, load_config
from rollhub.run.main import shipped_config
from rollhub.run.rundir import RunDirectory
from rollhub.run.step_parts import EnvShape
from rollhub.run.toml import dumps
from rollhub.train.ppo import PPOConfig, PPOLearner
from rollhub.train.ppo_loss import linear_schedule, minibatch_bounds, value_loss


def _fragments(n: int, length: int, seed: int = 0) -> list[SampleFragment]:
    rng = np.random.default_rng(seed)

    def one() -> SampleFragment:
        return SampleFragment(
            obs=rng.standard_normal((length, 3)).astype(np.float32), actions=rng.integers(0, 2, length),
            rewards=rng.standard_normal(length).astype(np.float32), terminated=np.zeros(length, bool),
            truncated=np.zeros(length, bool), logp=np.full(length, np.log(0.5), np.float32),
            values=rng.standard_normal(length).astype(np.float32), final_values=np.zeros(length, np.float32),
            bootstrap_obs=np.zeros(3, np.float32), bootstrap_value=0.0, state_in=None,
            versions=np.zeros(length, np.int64), episode_ids=np.zeros(length, np.int64),
        )  # fmt: skip

    return [one() for _ in range(n)]


ANNEALED = PPOConfig(lr=1e-3, lr_final=1e-4, clip=0.2, clip_final=0.02, anneal_steps=1000, epochs=1, seed=3)


def test_linear_schedule_starts_moves_linearly_and_holds_the_floor_past_the_horizon() -> None:
    assert linear_schedule(1e-3, 1e-4, 1000, 0) == pytest.approx(1e-3)
    assert linear_schedule(1e-3, 1e-4, 1000, 500) == pytest.approx(5.5e-4)
    assert linear_schedule(1e-3, 1e-4, 1000, 1000) == pytest.approx(1e-4)
    assert linear_schedule(1e-3, 1e-4, 1000, 10**7) == pytest.approx(1e-4)  # never below the floor
    assert linear_schedule(0.2, None, 1000, 500) == pytest.approx(0.2)  # no final: constant
    assert linear_schedule(1e-3, 0.0, 1000, 5000) == 0.0  # zero only when asked for


def test_updates_follow_the_schedules_over_trained_steps() -> None:
    learner = PPOLearner(3, 2, ANNEALED)
    used = [learner.update(_fragments(4, 125, seed=i)) for i in range(4)]  # 500 samples per update
    assert [s["lr"] for s in used] == pytest.approx([1e-3, 5.5e-4, 1e-4, 1e-4])
    assert [s["clip"] for s in used] == pytest.approx([0.2, 0.11, 0.02, 0.02])
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    assert learner.trained_steps == 2000


def test_without_finals_lr_and_clip_stay_constant() -> None:
    learner = PPOLearner(3, 2, PPOConfig(lr=3e-4, clip=0.3, anneal_steps=10, epochs=1))
    used = [learner.update(_fragments(2, 16, seed=i)) for i in range(2)]
    assert [(s["lr"], s["clip"]) for s in used] == [(3e-4, 0.3), (3e-4, 0.3)]


def test_minibatches_by_size_or_by_count() -> None:
    assert minibatch_bounds(600, None, 256) == [(0, 256), (256, 512), (512, 600)]
    assert minibatch_bounds(600, 4, None) == [(0, 150), (150, 300), (300, 450), (450, 600)]
    assert minibatch_bounds(600, None, None) == minibatch_bounds(600, 4, None)  # the default count
    assert minibatch_bounds(100, None, 256) == [(0, 100)]  # a batch smaller than one minibatch
    with pytest.raises(ValueError, match="both set"):
        minibatch_bounds(600, 4, 256)


def test_optimizer_steps_are_epochs_times_minibatches() -> None:
    learner = PPOLearner(3, 2, PPOConfig(epochs=3, minibatch_size=100))
    learner.update(_fragments(5, 50))  # 250 samples: minibatches of 100, 100, 50
    assert int(learner.optimizer.state_dict()["state"][0]["step"]) == 9


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"minibatches": 4, "minibatch_size": 64}, "both set"),
        ({"minibatch_size": 0}, "minibatch_size must be >= 1"),
        ({"anneal_steps": 0}, "anneal_steps must be >= 1"),
    ],
)
def test_ppo_config_refuses_bad_minibatch_and_schedule_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PPOConfig(**kwargs)


def _value_loss(value: float, returns: float, old: float, clip_vf: float | None) -> tuple[float, float]:
    """The value loss of one sample and its gradient with respect to the value, through autograd."""
    v = torch.tensor([value], requires_grad=True)
    loss = value_loss(v, torch.tensor([returns]), torch.tensor([old]), clip_vf)
    loss.backward()
    return loss.item(), v.grad.item()


def test_value_clipping_takes_the_larger_error_of_the_clipped_prediction() -> None:
    assert _value_loss(3.0, 3.0, 0.0, None)[0] == pytest.approx(0.0)
    clipped, grad = _value_loss(3.0, 3.0, 0.0, 1.0)  # the clipped prediction is 1: error 2
    assert clipped == pytest.approx(0.5 * 4.0)
    assert grad == 0.0  # no push beyond clip_vf from the old value
    # when the unclipped error is the larger one, it counts (and pulls) as without clipping
    assert _value_loss(3.0, 0.0, 0.0, 1.0)[0] == pytest.approx(0.5 * 9.0)
    assert _value_loss(3.0, 0.0, 0.0, 1.0)[1] == pytest.approx(_value_loss(3.0, 0.0, 0.0, None)[1])
    # inside the clip range nothing changes
    assert _value_loss(0.5, 3.0, 0.0, 1.0) == pytest.approx(_value_loss(0.5, 3.0, 0.0, None))


def test_value_clipping_changes_an_update() -> None:
    data = _fragments(2, 32)
    one_step = {"seed": 1, "epochs": 1, "minibatches": 1}  # the losses of the same weights
    plain = PPOLearner(3, 2, PPOConfig(**one_step)).update(data)
    clipped = PPOLearner(3, 2, PPOConfig(**one_step, clip_vf=0.01)).update(data)
    assert clipped["policy_loss"] == pytest.approx(plain["policy_loss"])
    assert clipped["value_loss"] > plain["value_loss"]


def test_trainer_keys_round_trip_through_the_written_config_and_reach_the_learner() -> None:
    sets = ["trainer.lr_final=1e-5", "trainer.clip_final=0.05", "trainer.anneal_steps=5000", "trainer.clip_vf=0.5",
            "trainer.minibatch_size=64", "trainer.norm_adv=false"]  # fmt: skip
    config = load_config(shipped_config("cartpole"), sets)
    text = dumps(config.model_dump(mode="json"))
    assert load_config(tomllib.loads(text)) == config
    cfg = ppo_learner(config, EnvShape(obs_dim=4, n_actions=2), None).config
    assert (cfg.lr_final, cfg.clip_final, cfg.anneal_steps, cfg.clip_vf) == (1e-5, 0.05, 5000, 0.5)
    assert (cfg.minibatch_size, cfg.minibatches, cfg.norm_adv) == (64, None, False)
    off = load_config(shipped_config("cartpole"), ["trainer.clip_vf=false", "trainer.minibatch_size=32"])
    assert off.trainer.clip_vf is None
    assert tomllib.loads(dumps(off.model_dump(mode="json")))["trainer"]["clip_vf"] is False  # TOML has no null


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (["trainer.lr_final=-1e-4"], "  trainer.lr_final: Input should be greater than or equal to 0"),
        (["trainer.clip_final=-0.1"], "  trainer.clip_final: Input should be greater than or equal to 0"),
        (["trainer.anneal_steps=0"], "  trainer.anneal_steps: Input should be greater than or equal to 1"),
        (["trainer.clip_vf=0"], "  trainer.clip_vf: Input should be greater than 0"),
        (["trainer.clip_vf=true"], "  trainer.clip_vf: Value error, true is not a setting"),
        (["trainer.minibatch_size=0"], "  trainer.minibatch_size: Input should be greater than or equal to 1"),
        (["trainer.minibatches=4", "trainer.minibatch_size=64"], "  trainer.minibatch_size: Value error, trainer."
         "minibatches is set too; set one of minibatches"),
    ],
)  # fmt: skip
def test_bad_trainer_values_name_their_key(sets: list[str], line: str) -> None:
    data = shipped_config("cartpole")
    data["trainer"].pop("minibatch_size", None)
    with pytest.raises(RunConfigError) as caught:
        load_config(data, sets)
    assert any(row.startswith(line) for row in str(caught.value).splitlines()), str(caught.value)


def test_the_shipped_cartpole_config_stays_asynchronous_with_eight_envs() -> None:
    config = load_config(shipped_config("cartpole"))
    assert config.writer.max_staleness >= 1
    assert config.fleet.workers * config.fleet.envs_per_worker == 8


def test_resume_continues_the_schedules_where_the_checkpoint_left_them(tmp_path: Path) -> None:
    learner = PPOLearner(3, 2, ANNEALED)
    for i in range(2):
        learner.update(_fragments(4, 125, seed=i))
    arrays, values = learner.state_dict()
    rundir = RunDirectory(tmp_path)
    rundir.save_checkpoint(2, arrays, {"learner": values})
    resumed = rundir.latest_checkpoint()
    restored = PPOLearner(3, 2, ANNEALED)
    restored.load_state_dict(resumed.arrays, resumed.values["learner"])
    assert restored.trained_steps == 1000 and restored.schedule() == pytest.approx((1e-4, 0.02))
    data = _fragments(4, 125, seed=7)
    torch_state = torch.get_rng_state()
    expected = learner.update(data)
    torch.set_rng_state(torch_state)
    assert restored.update(data) == expected
