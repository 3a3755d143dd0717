"""Episodes through the plane: env -> Group -> every path a group travels -> GRPO's batch, and at the end of each
path the trained positions are still exactly what the engine sampled (masks of -100 in the middle of rows, a forked
episode's two rows, per-row episode records and messages included)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from episode_fakes import REWRITING_TEMPLATE, FollowUpEnv, ScriptedPolicy, assert_exact_rows, batch_rows, solver
from fastapi.testclient import TestClient

from rollhub.buffer.sqlite import SqliteStorage
from rollhub.envs.episode import ChatRenderer, EpisodeGroupEnv, EpisodeLimits
from rollhub.envs.episode.calculator import CalculatorEnv
from rollhub.experience import Group
from rollhub.experience.episodes import episode_count
from rollhub.rollout.group.files import FileRolloutWriter, read_rollout_groups
from rollhub.run.sources import GroupQueue
from rollhub.server import ServerSettings, create_app
from rollhub.server.storage import GROUP_CODEC
from rollhub.train.grpo_loss import groups_to_batch
from rollhub.wire import codec
from rollhub.wire.group import group_from_json, group_to_item
from rollhub.wire.models import ScoredData

N = 3
REGISTRATION = {
    "wandb_group": "g", "wandb_project": "p", "batch_size": 2 * N, "max_token_len": 2048, "checkpoint_dir": "/tmp/c",
    "save_checkpoint_interval": 10, "starting_step": 0, "num_steps": 10,
}  # fmt: skip
ENV = {"max_token_length": 2048, "desired_name": "episodes", "weight": 1.0, "group_size": N}


@pytest.fixture(scope="module")
def sampled(tiny_tokenizer: Any) -> tuple[list[Group], ScriptedPolicy]:
    """A tool group (one row per episode, two sampled spans per row) and a forked group (two rows per episode)."""
    policy = ScriptedPolicy(tiny_tokenizer, solver)
    limits = EpisodeLimits(max_tokens=250, turn_max_tokens=100)
    rng = np.random.default_rng(0)
    tools, _ = EpisodeGroupEnv(CalculatorEnv(), ChatRenderer(tiny_tokenizer), limits).sample(policy, 1, N, "train",
                                                                                             rng)  # fmt: skip
    policy.script = lambda text: "<think>add</think>46"
    rewriting = ChatRenderer(tiny_tokenizer, chat_template=REWRITING_TEMPLATE)
    forked, _ = EpisodeGroupEnv(FollowUpEnv(), rewriting, limits).sample(policy, 1, N, "train", rng)
    for i, g in enumerate([*tools, *forked]):
        g.policy_version = 0
        g.meta["generation_params"]["temperature"] = 0.7 + 0.1 * i  # tells the groups apart after a trip
    assert tools[0].size == N and forked[0].size == 2 * N and episode_count(forked[0]) == N
    return [tools[0], forked[0]], policy


def assert_same(sent: list[Group], got: list[Group], policy: ScriptedPolicy) -> None:
    """The groups came back unchanged, and the trainer's batch of them trains exactly the engine's samples."""
    assert len(got) == len(sent)
    for a, b in zip(sent, got, strict=True):
        for name in ("tokens", "masks", "inference_logprobs"):
            x, y = getattr(a, name), getattr(b, name)
            np.testing.assert_array_equal(x.offsets, y.offsets)
            np.testing.assert_array_equal(np.asarray(x.data, np.float64), np.asarray(y.data, np.float64))
        np.testing.assert_array_equal(a.scores, b.scores)
        for name in ("overrides", "messages", "generation_params", "group_overrides"):
            assert b.meta.get(name) == a.meta.get(name), name
        assert b.policy_version == a.policy_version
        assert episode_count(b) == N
    assert assert_exact_rows(batch_rows(groups_to_batch(got)), policy.handed_out) == 2 * N + 2 * N


def test_masks_inside_rows_survive_the_buffer_server_json_and_msgpack(sampled: Any, tmp_path: Path) -> None:
    groups, policy = sampled
    msgpack_in = {"Content-Type": codec.MEDIA_TYPE}
    with TestClient(create_app(ServerSettings(storage=f"sqlite:///{tmp_path}/a.db"))) as c:
        c.post("/register", json=REGISTRATION)
        assert c.get("/batch").json() == {"batch": None}
        env_id = c.post("/register-env", json=ENV).json()["env_id"]
        for g in groups:
            g.env_id = env_id
        for first, second in [(0, 1), (1, 0)]:  # each group once as JSON and once as msgpack
            json_item = group_to_item(groups[first]) | {"scores": list(groups[first].scores)}
            ScoredData.model_validate(json_item)  # an Atropos consumer's model: tokens, masks, logprobs, messages
            assert c.post("/scored_data", content=orjson_dumps(json_item)).json() == {"status": "received"}
            # the forked group has 2N rows but N episodes: a whole group of group_size N, neither held nor refused
            answer = c.post("/scored_data", content=codec.pack_group(groups[second]), headers=msgpack_in).json()
            assert answer == {"status": "received"}
        assert c.get("/status").json()["queue_size"] == 4
        served = c.get("/batch", params={"lease_s": 60}, headers={"Accept": codec.MEDIA_TYPE})
        assert_same(groups, [codec.group_from_map(item) for item in msgpack.unpackb(served.content)["batch"]], policy)
        served = c.get("/batch", params={"lease_s": 60}).json()["batch"]
        assert_same(groups[::-1], [group_from_json(item) for item in served], policy)
    # the same groups, read back from the sqlite file by a buffer reopened on it, as JSON
    storage = SqliteStorage(tmp_path / "a.db", codec=GROUP_CODEC)
    stored = storage.payloads([item.entry.gid for item in storage.load().items])
    assert [item.entry.size for item in storage.load().items] == [N] * 4  # sized by episodes, as when queued
    assert_same(groups, [group_from_json(orjson_loads(orjson_dumps(group_to_item(g)))) for g in stored[:2]], policy)
    storage.close()


def test_masks_inside_rows_survive_files_pickles_and_the_in_process_queue(sampled: Any, tmp_path: Path) -> None:
    groups, policy = sampled
    with FileRolloutWriter(tmp_path / "rollouts.jsonl") as writer:
        writer.write(groups)
    (from_file,) = list(read_rollout_groups(tmp_path / "rollouts.jsonl"))
    assert_same(groups, from_file, policy)
    assert_same(groups, pickle.loads(pickle.dumps(groups)), policy)  # what Ray's object store and actors carry
    queue = GroupQueue(batch_size=2 * N)  # episodes, as the server counts them: the forked group's 2N rows are N
    queue.put(groups[1:])
    assert queue.next_batch() is None
    queue.put(groups[:1])
    assert_same(groups[::-1], queue.next_batch() or [], policy)


def orjson_dumps(obj: Any) -> bytes:
    import orjson

    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def orjson_loads(body: bytes) -> Any:
    import orjson

    return orjson.loads(body)


def test_a_rollout_manager_samples_episode_groups_like_any_other(tiny_tokenizer: Any) -> None:
    from rollhub.curriculum.config import CurriculumConfig, LessonConfig
    from rollhub.rollout.group.manager import GroupRolloutManager
    from rollhub.rollout.protocols import SampleRequest

    limits = EpisodeLimits(max_tokens=250, turn_max_tokens=100)
    env = EpisodeGroupEnv(CalculatorEnv(), ChatRenderer(tiny_tokenizer), limits)
    lessons = (LessonConfig("calc", "calculator", n_examples=2, n_generations=N),)
    policy = ScriptedPolicy(tiny_tokenizer, solver)
    manager = GroupRolloutManager(CurriculumConfig(lessons), policy, env_loader=lambda spec, args: env)
    result = manager.sample_batch(SampleRequest(7, "worker-a", lesson_id="calc"))
    assert len(result.items) == 2 and result.metrics["accuracy"] == 1.0
    for g in result.items:
        assert g.policy_version == 7 and g.meta["group_overrides"]["rollhub"]["worker_id"] == "worker-a"
        assert g.meta["group_overrides"]["rollhub"]["episodes"] == N  # the stamp keeps the episode counts
        assert episode_count(g) == N
    assert assert_exact_rows(batch_rows(groups_to_batch(result.items)), policy.handed_out) == 4 * N
    manager.shutdown()


def test_stats_count_a_forked_episode_once(sampled: Any) -> None:
    from rollhub.envs.group.scored import GroupStats, correct_flags

    (tools, forked), _ = sampled
    forked = forked.copy() if hasattr(forked, "copy") else pickle.loads(pickle.dumps(forked))
    info = forked.meta["group_overrides"]["rollhub"]
    # episode 0 solved, the others not: by rows that is 2 of 2N, by episodes 1 of N
    info["correct"] = [True, True] + [False] * (forked.size - 2)
    forked.scores = np.asarray([1.0, 1.0] + [0.0] * (forked.size - 2))
    stats = GroupStats.of([forked])
    assert (
        stats.n_sequences == N and stats.accuracy == pytest.approx(1 / N) and stats.mean_reward == pytest.approx(1 / N)
    )
    assert correct_flags(forked).mean() == pytest.approx(2 / forked.size)  # the rows themselves are untouched
    plain = GroupStats.of([tools])
    assert plain.n_sequences == tools.size  # one row per episode: rows and episodes agree
