"""Prioritized task sampling: training draws favour the tasks the policy fails; held-out draws are untouched."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from episode_fakes import ScriptedPolicy, solver

from rollhub.envs.episode import (
    ChatRenderer,
    EnvReply,
    Episode,
    EpisodeGroupEnv,
    EpisodeLimits,
    ModelTurn,
    Outcome,
    Task,
)
from rollhub.envs.episode.calculator import CalculatorEnv
from rollhub.envs.episode.prioritized import PrioritizedTasks
from rollhub.errors import ConfigError
from rollhub.inference.base import SamplingParams


class PoolEnv:
    """Ten training tasks ``t0``..``t9`` and two held-out ones, drawn uniformly with replacement; an episode is
    solved when the task's id is in ``easy``."""

    name = "pool"

    def __init__(self, easy: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.easy = set(easy)

    def tasks(self, n: int, mode: str, rng: np.random.Generator) -> list[Task]:
        ids = [f"t{i}" for i in range(10)] if mode == "train" else ["e0", "e1"]
        return [Task(ids[i], [{"role": "user", "content": "?"}]) for i in rng.integers(len(ids), size=n)]

    def step(self, task: Task, episode: Episode, turn: ModelTurn) -> EnvReply:
        return EnvReply(done=True)

    def outcome(self, task: Task, episode: Episode) -> Outcome:
        return Outcome(1.0, task.id in self.easy)


def _judge(env: PrioritizedTasks, task: Task) -> Outcome:
    return env.outcome(task, None)  # type: ignore[arg-type]  # PoolEnv judges by the task alone


def test_tasks_solved_every_time_are_drawn_far_less_than_uniformly_but_still_drawn() -> None:
    env = PrioritizedTasks(PoolEnv(easy={f"t{i}" for i in range(5)}), candidates=4, floor=0.05, window=4)
    rng = np.random.default_rng(0)
    for task in env.tasks(400, "train", rng):  # every task recorded: half always solved, half never
        for _ in range(4):
            _judge(env, task)
    assert [env.weight(f"t{i}") for i in range(10)] == [0.05] * 5 + [1.0] * 5
    drawn = Counter(t.id for _ in range(500) for t in env.tasks(4, "train", rng))
    easy = sum(drawn[f"t{i}"] for i in range(5)) / sum(drawn.values())
    assert 0 < easy < 0.15  # uniform draws would give 0.5
    assert env.stats() == {"tasks_seen": 10.0, "tasks_solved": 5.0}


def test_a_task_weighs_one_minus_its_recent_success_and_forgets_beyond_the_window() -> None:
    env = PrioritizedTasks(PoolEnv(), floor=0.1, window=4)
    assert env.weight("t0") == 1.0 and env.success("t0") is None
    for solved in (True, True, True, False):
        env.record("t0", solved)
    assert env.success("t0") == 0.75 and env.weight("t0") == pytest.approx(0.25)
    for _ in range(4):
        env.record("t0", True)  # the failure has left the window of 4
    assert env.success("t0") == 1.0 and env.weight("t0") == 0.1


def test_held_out_draws_pass_through_and_their_outcomes_are_not_recorded() -> None:
    inner, env = PoolEnv(easy={"e0", "e1"}), PrioritizedTasks(PoolEnv(easy={"e0", "e1"}))
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    held_out = env.tasks(6, "eval", a)
    assert [t.id for t in held_out] == [t.id for t in inner.tasks(6, "eval", b)]
    for task in held_out:
        assert _judge(env, task).correct
    assert env.success("e0") is None and env.stats()["tasks_seen"] == 0


def test_one_candidate_draws_as_the_environment_does() -> None:
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    env = PrioritizedTasks(PoolEnv(), candidates=1)
    env.record("t3", True)
    assert [t.id for t in env.tasks(20, "train", a)] == [t.id for t in PoolEnv().tasks(20, "train", b)]


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"candidates": 0}, "candidates"), ({"floor": 0.0}, "floor"), ({"window": 0}, "window")]
)
def test_bad_settings_are_refused_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        PrioritizedTasks(PoolEnv(), **kwargs)


def test_the_episode_loop_records_each_training_problems_outcome(tiny_tokenizer: Any) -> None:
    """Through EpisodeGroupEnv: a policy that solves ``a*b`` only when ``a`` is even leaves odd problems heavier."""

    def even_solver(text: str) -> str:
        a = text.split("user: ")[-1].split("*")[0]
        return solver(text) if int(a) % 2 == 0 else "7"

    env = PrioritizedTasks(CalculatorEnv(), candidates=2)
    groups_env = EpisodeGroupEnv(env, ChatRenderer(tiny_tokenizer), EpisodeLimits(250, 100), SamplingParams())
    groups, _ = groups_env.sample(ScriptedPolicy(tiny_tokenizer, even_solver), 6, 2, "train", np.random.default_rng(1))
    ids = [g.meta["group_overrides"]["rollhub"]["example_id"] for g in groups]
    assert len(ids) == 6
    for id_ in ids:
        assert env.success(id_) == (1.0 if int(id_.split("*")[0]) % 2 == 0 else 0.0)
        assert env.weight(id_) == (env.floor if int(id_.split("*")[0]) % 2 == 0 else 1.0)
