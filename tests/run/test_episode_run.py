"""``rollhub run`` with a multi-turn environment (``[env.episode]``), without vLLM: a fake engine answers the
completions route with a scripted calculator agent and takes the weight pushes; the groups that reach the GRPO
trainer hold exactly the tokens the engine sampled and the environment's rendered tokens between them, with
their masks, in process and through the Ray fleet and the buffer server (sqlite); the config checks of such a
run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollhub.envs.episode.calculator import CalculatorEnv
from rollhub.experience.episodes import episode_count, episode_index
from rollhub.inference.base import SamplingParams
from rollhub.run.config import RunConfigError, load_config
from rollhub.run.main import execute
from rollhub.train.grpo import GRPOTrainer
from rollhub.train.grpo_loss import groups_to_batch
from tests.episode.episode_fakes import ScriptedPolicy, assert_exact_rows, batch_rows, completion_choices
from tests.run.external_fakes import FakeEngine, Served

LO, HI = 2, 4
GROUP_SIZE, GROUPS = 2, 2


def calls(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "calc", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 whose tokenizer (tool-format chat template) knows the calculator's episodes."""
    from rollhub.models import TinyModelSpec, build_tiny_model

    pairs = [(a, b) for a in range(LO, HI + 1) for b in range(LO, HI + 1)]
    corpus = tuple(f"system: tools calc(a, b)\nuser: {a}*{b}=?\nassistant: {calls(a, b)}\n"
                   f"tool: <tool_response>{a * b}</tool_response>\nassistant: {a * b}\n" for a, b in pairs)  # fmt: skip
    spec = TinyModelSpec(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                         vocab_size=120, corpus=corpus, all_bytes=False)  # fmt: skip
    return build_tiny_model(tmp_path_factory.mktemp("episode-model") / "model", spec)


class Agent:
    """Calls ``calc`` with the task's operands, then answers what it returned, except every third answer, which is
    wrong (so the scores of a group differ and GRPO has advantages to train)."""

    def __init__(self) -> None:
        self.answers = 0

    def __call__(self, text: str) -> str:
        if "<tool_response>" not in text:
            a, b = text.split("user: ")[-1].split("=?")[0].split("*")
            return calls(int(a), int(b))
        self.answers += 1
        product = text.split("<tool_response>")[-1].split("</tool_response>")[0]
        return product if self.answers % 3 else "0"


class EpisodeEngine(FakeEngine):
    """The weight routes of :class:`FakeEngine` and ``POST /v1/completions`` answered by a :class:`ScriptedPolicy`
    the way vLLM answers (token ids, prompt ids, per-token log-probs)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.policy = ScriptedPolicy(tokenizer, Agent())

    def app(self) -> Starlette:
        app = super().app()

        async def completions(request: Request) -> JSONResponse:
            body = await request.json()
            params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"])
            rng = np.random.default_rng()
            out = await run_in_threadpool(self.policy.complete, body["prompt"], body["n"], params, rng)
            choices = completion_choices(out, body["n"])
            return JSONResponse({"id": "cmpl-1", "object": "text_completion", "choices": choices})

        app.router.routes.append(Route("/v1/completions", completions, methods=["POST"]))
        return app


@pytest.fixture
def trained(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[Any]]]:
    """Every batch of groups the GRPO trainer steps on (this process trains, whatever writes the groups)."""
    batches: list[list[Any]] = []
    step = GRPOTrainer.step

    def recording(self: GRPOTrainer, groups: Any, *args: Any, **kwargs: Any) -> Any:
        batches.append(list(groups))
        return step(self, groups, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "step", recording)
    yield batches


def episode_config(run_dir: Path, model: Path, engine_url: str, **sections: Any) -> dict[str, Any]:
    """A run of the calculator's episodes on the tiny model, sampled through the engine at ``engine_url``."""
    base: dict[str, Any] = {
        "run": {"name": "calc", "dir": str(run_dir), "max_updates": 3, "progress": False, "max_seconds": 300},
        "env": {
            "kind": "group",
            "id": "calculator",
            "group_size": GROUP_SIZE,
            "kwargs": {"lo": LO, "hi": HI},
            "episode": {"max_tokens": 200, "turn_max_tokens": 48, "max_turns": 3},
        },
        "policy": {"kind": "hf", "model": str(model), "max_len": 256},
        "inference": {"url": engine_url, "probe_every": 0},
        "writer": {"kind": "in_process"},
        "trainer": {"groups_per_batch": GROUPS, "mismatch_warn": False},  # the fake's log-probs are not the model's
        "eval": {"every": 2},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return base


def assert_trained_exactly(batches: list[list[Any]], engine: EpisodeEngine, tokenizer: Any) -> None:
    """Each trained group is ``GROUP_SIZE`` whole episodes; every sampled span of every row (as grouped and as
    batched for the loss) is what the engine returned for exactly the row before it, every other position is
    masked, and the row is the rendered conversation, token for token."""
    handed_out = engine.policy.handed_out
    tools = CalculatorEnv().tool_schemas()
    assert batches and all(sum(episode_count(g) for g in groups) == GROUPS * GROUP_SIZE for groups in batches)
    for groups in batches:
        for g in groups:
            assert episode_count(g) == GROUP_SIZE and list(episode_index(g)) == list(range(GROUP_SIZE))
            assert assert_exact_rows(g, handed_out) == 2 * g.size  # a call, then the answer: one row each
            for tokens, messages in zip(g.tokens.rows(), g.meta["messages"], strict=True):
                rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
                # the row is the prompt's <bos>, then the conversation, ending at the last turn's sampled stop
                assert tokenizer.decode(list(tokens)) + "\n" == tokenizer.bos_token + rendered
        assert assert_exact_rows(batch_rows(groups_to_batch(groups)), handed_out) == 2 * sum(g.size for g in groups)
    scores = np.concatenate([g.scores for groups in batches for g in groups])
    assert len(set(scores.tolist())) > 1  # wrong answers scored below right ones: there was something to train


def run_episodes(config: dict[str, Any], engine: EpisodeEngine) -> dict[str, Any]:
    with Served(engine.app()) as served:
        config["inference"]["url"] = served.url
        assert execute(load_config(config)) == 0
    return json.loads((Path(config["run"]["dir"]) / "summary.json").read_text())


def test_an_episode_run_in_process_trains_the_exact_tokens_and_masks(
    tmp_path: Path, model_dir: Path, trained: list[list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import rollhub.run.probe
    from rollhub.models import load_tokenizer

    probed: list[list[int]] = []
    measure = rollhub.run.probe.probe_mismatch

    def recording(model: Any, client: Any, prompts: list[list[int]], *args: Any) -> dict[str, float]:
        probed.extend(prompts)
        return measure(model, client, prompts, *args)

    monkeypatch.setattr(rollhub.run.probe, "probe_mismatch", recording)

    tokenizer = load_tokenizer(str(model_dir))
    engine = EpisodeEngine(tokenizer)
    # the environment named as user code is ("package.module:Class"), not by its short name
    spec = "rollhub.envs.episode.calculator:CalculatorEnv"
    # the engine probe runs after every update, on the held-out episodes' openings
    config = episode_config(tmp_path / "run", model_dir, "", env={"id": spec}, inference={"probe_every": 1})
    summary = run_episodes(config, engine)
    assert summary["steps"] == 3 and summary["variant"] == "in-process" and summary["stop_reason"] == "update limit"
    assert len(trained) == 3
    assert_trained_exactly(trained, engine, tokenizer)
    assert engine.versions == ["0", "1", "2", "3"]  # every update pushed into the engine
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3] and all(r["off_size_groups"] == 0 for r in rows)
    assert summary["eval_accuracy"] is not None  # greedy episodes of the held-out products were judged
    assert summary["mismatch"]["probe_updates"] == 3 and summary["mismatch"]["probe_median_abs"] is not None
    # each probe prompt is a held-out episode's opening, as its first turn was asked: the tool results and template
    # tokens masked later in the row are not part of it
    held_out = [CalculatorEnv(lo=LO, hi=HI).task(a, b) for a, b in CalculatorEnv(lo=LO, hi=HI).eval_problems]
    tools = CalculatorEnv().tool_schemas()
    render = tokenizer.apply_chat_template
    openings = {
        tokenizer.bos_token + render(t.messages, tools=tools, tokenize=False, add_generation_prompt=True)
        for t in held_out
    }
    assert probed and {tokenizer.decode(p) for p in probed} <= openings


@pytest.mark.ray
def test_an_episode_run_through_the_ray_fleet_and_the_server_trains_the_exact_tokens_and_masks(
    tmp_path: Path, model_dir: Path, trained: list[list[Any]]
) -> None:
    from rollhub.models import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    engine = EpisodeEngine(tokenizer)
    config = episode_config(tmp_path / "run", model_dir, "", writer={"kind": "server", "storage": "sqlite:///buf.db"},
                            fleet={"workers": 1})  # fmt: skip
    summary = run_episodes(config, engine)
    assert summary["steps"] == 3 and summary["variant"] == "distributed" and summary["stop_reason"] == "update limit"
    assert len(trained) == 3
    assert_trained_exactly(trained, engine, tokenizer)


def test_an_episode_environment_is_checked_before_anything_starts(tmp_path: Path, model_dir: Path) -> None:
    from rollhub.run.group_parts import probe_group_env

    config = load_config(episode_config(tmp_path / "run", model_dir, "http://127.0.0.1:9"))
    curriculum = probe_group_env(config)  # the environment builds, its chat template from the model directory
    assert curriculum is not None
    lesson = curriculum.lessons[0]
    assert lesson.env_spec == "episodes" and lesson.n_generations == GROUP_SIZE
    assert lesson.env_args == {"env": "calculator", "tokenizer": str(model_dir), "max_tokens": 200,
                               "turn_max_tokens": 48, "max_turns": 3, "discount": 1.0,
                               "env_kwargs": {"lo": LO, "hi": HI}}  # fmt: skip
    bad = episode_config(tmp_path / "run", model_dir, "http://127.0.0.1:9", env={"kwargs": {"lo": 5, "hi": 3}})
    with pytest.raises(RunConfigError, match=r"env: need 0 <= lo < hi"):
        probe_group_env(load_config(bad))
    arithmetic = "rollhub.envs.group.arithmetic:ArithmeticEnv"
    not_episodes = episode_config(tmp_path / "run", model_dir, "", env={"id": arithmetic, "kwargs": {}})
    with pytest.raises(RunConfigError, match=rf"env: '{arithmetic}' built ArithmeticEnv, which lacks"):
        probe_group_env(load_config(not_episodes))


def test_the_tiny_models_episode_environment_renders_with_the_model_the_run_builds(tmp_path: Path) -> None:
    from rollhub.run.group_parts import probe_group_env

    data = {
        "run": {"dir": str(tmp_path / "run")},
        "env": {"kind": "group", "id": "calculator", "episode": {"max_tokens": 60, "turn_max_tokens": 20}},
        "policy": {"kind": "hf", "model": "tiny", "max_len": 64},
    }
    curriculum = probe_group_env(load_config(data))  # the model is not built yet: the environment alone is checked
    assert curriculum is not None
    assert curriculum.lessons[0].env_args["tokenizer"] == str((tmp_path / "run" / "model").resolve())


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"env": {"episode": {"max_turns": 0}}}, "env.episode.max_turns"),
        ({"env": {"episode": {"discount": 1.5}}}, "env.episode.discount"),
        ({"env": {"episode": {"turn_max_tokens": 300}}}, "env.episode.turn_max_tokens 300 must be below"),
        ({"env": {"episode": {"max_tokens": 500}}}, "env.episode.max_tokens: 500 exceeds policy.max_len 256"),
        ({"env": {"episode": {"max_tokenz": 5}}}, "max_tokenz"),
        ({"sampling": {"max_tokens": 10}}, "sampling.max_tokens: an episode's turns are capped"),
        ({"policy": {"kind": "transformer", "model": None, "max_len": None}}, "env.episode: episodes are rendered"),
        ({"env": {"id": "episodes"}}, "env.id: with [env.episode], env.id names the multi-turn environment itself"),
        ({"env": {"id": "arithmetic"}}, "env.id: 'arithmetic' is a single-turn group environment"),
    ],
)
def test_episode_settings_that_cannot_run_are_named(sections: dict[str, Any], message: str) -> None:
    data = episode_config(Path("unused"), Path("unused"), "http://127.0.0.1:9")
    for key, value in sections.items():
        table = dict(data.get(key, {}))
        for k, v in value.items():
            if isinstance(v, dict) and isinstance(table.get(k), dict):
                table[k] = {**table[k], **v}
            elif v is None:
                table.pop(k, None)
            else:
                table[k] = v
        data[key] = table
    if data["policy"]["kind"] == "transformer":
        data.pop("inference")
    with pytest.raises(RunConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_config(data)


def test_a_multi_turn_environment_without_its_episode_table_is_named(tmp_path: Path) -> None:
    from rollhub.run.group_parts import probe_group_env

    data = {"env": {"kind": "group", "id": "calculator"}, "policy": {"kind": "hf", "model": "tiny"}}
    with pytest.raises(RunConfigError, match=r"env: 'calculator' is a multi-turn environment; add an \[env.episode\]"):
        probe_group_env(load_config(data))
    data["env"]["id"] = "rollhub.envs.episode.calculator:CalculatorEnv"
    with pytest.raises(RunConfigError, match=r"a multi-turn environment \(tasks, step, outcome\), not a group"):
        probe_group_env(load_config(data))


def test_the_example_episode_config_loads_and_its_environment_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollhub.envs.loading import USER_PATH_ENV
    from rollhub.run.config import read_toml
    from rollhub.run.group_parts import probe_group_env

    example = Path(__file__).parents[2] / "examples" / "tools"
    monkeypatch.setenv(USER_PATH_ENV, str(example))  # what rollhub run does for a module beside its config
    sets = ['policy.model="tiny"', f"run.dir={str(tmp_path / 'run')!r}"]  # no download: the tiny model's template
    curriculum = probe_group_env(load_config(read_toml(example / "capitals.toml"), sets))
    assert curriculum is not None
    (lesson,) = curriculum.lessons
    assert lesson.env_spec == "episodes" and lesson.env_args["env"] == "capitals:CapitalsEnv"
    assert lesson.env_args["max_turns"] == 4 and lesson.n_generations == 8

    from capitals import CapitalsEnv

    rng = np.random.default_rng(0)
    env = CapitalsEnv()
    held_out = {t.id for t in env.tasks(10, "eval", rng)}
    assert held_out and not held_out & {t.id for t in env.tasks(50, "train", rng)}
