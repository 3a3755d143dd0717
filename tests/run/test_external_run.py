"""The trainer-only run (``env.kind = "external"``) without vLLM: a fake engine takes the weight pushes, a fake
environment posts groups the way Atropos's ``BaseEnv`` does; the config checks of such a run."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("transformers")

from rollhub.experience.versions import KINDS
from rollhub.run.config import RunConfigError, load_config
from rollhub.run.main import execute
from tests.conftest import ServerProcess
from tests.run.external_fakes import AtroposLikeEnv, FakeEngine, Served

TINY = {"corpus": ["0123456789+="], "all_bytes": False, "vocab_size": 16, "hidden_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 128}  # fmt: skip


def external_config(run_dir: Path, engine_url: str, **sections: Any) -> dict[str, Any]:
    """A trainer-only run on the tiny Qwen2 with the engine at ``engine_url``, ``sections`` laid over it."""
    base: dict[str, Any] = {
        "run": {"name": "ext", "dir": str(run_dir), "max_updates": 3, "progress": False, "max_seconds": 300},
        "env": {"kind": "external", "group_size": 4},
        "policy": {"model": "tiny", "tiny": TINY, "max_len": 64},
        "inference": {"url": engine_url, "probe_every": 0},
        "writer": {"storage": "memory"},
        "trainer": {"groups_per_batch": 2},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return base


def random_group(i: int, size: int = 4) -> dict[str, Any]:
    """A scored group of ``size`` sequences: a 3-token prompt (mask -100), 3 completion tokens; even groups send
    log-probs, odd ones none (as most Atropos environments)."""
    rng = np.random.default_rng(i)
    tokens = [[1, 5, 6, *map(int, rng.integers(2, 16, 3))] for _ in range(size)]
    masks = [[-100, -100, -100, *row[3:]] for row in tokens]
    logprobs = [[1.0, 1.0, 1.0, *map(float, -rng.uniform(0.5, 3.0, 3))] for _ in range(size)]
    group = {"tokens": tokens, "masks": masks, "scores": [float(s) for s in rng.integers(0, 2, size)]}
    return {**group, "inference_logprobs": logprobs} if i % 2 == 0 else group


def test_a_trainer_only_run_trains_on_what_an_external_environment_posts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = FakeEngine()
    run_dir = tmp_path / "run"
    with Served(engine.app()) as served:
        config = load_config(external_config(run_dir, served.url))
        env = AtroposLikeEnv(run_dir, random_group, group_size=4)
        env.start()
        assert execute(config) == 0
        env.join(60)
    assert env.error is None, env.error
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["variant"] == "external" and summary["stop_reason"] == "update limit"
    assert summary["eval_accuracy"] is None and summary["eval_problems"] == "none evaluated"  # no rollhub evaluator
    assert engine.versions == ["0", "1", "2", "3"]  # the initial weights, then every update, pushed in order
    assert summary["weight_pushes"] == 4
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    assert endpoints["openai_base_url"] == f"{served.url}/v1" and endpoints["server_url"].startswith("http://127.")
    assert endpoints["model_name"] == endpoints["tokenizer"] == str(run_dir / "model")  # the tiny model built
    assert env.endpoints == endpoints and len(env.sent) >= 6  # 3 batches of 2 groups
    err = capsys.readouterr().err
    for value in (endpoints["server_url"], endpoints["openai_base_url"], endpoints["model_name"]):
        assert value in err
    assert "--openai.server_type openai" in err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3] and all("eval_accuracy" not in r for r in rows)
    assert 0 < np.mean([r["recomputed_fraction"] for r in rows]) < 1  # groups without log-probs were trained on
    assert env.stamps and all(isinstance(v, int) for v in env.stamps)  # the server versioned every group
    assert all(r["off_size_groups"] == 0 for r in rows)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"fleet": {"workers": 2, "envs_per_worker": 1}}, "fleet: a run with env.kind = 'external' starts no"),
        ({"writer": {"kind": "in_process"}}, "writer.kind: 'in_process' does not go with env.kind = 'external'"),
        ({"policy": {"kind": "transformer"}}, "policy.kind: 'transformer' does not go with env.kind = 'external'"),
        ({"eval": {"target_accuracy": 0.5}}, "eval.target_accuracy: rollhub evaluates a run with env.kind"),
        ({"eval": {"every": 5}}, "eval: rollhub evaluates a run with env.kind = 'external' only on env.eval_id"),
        ({"curriculum": {"lessons": [{"id": "a"}]}}, "curriculum: an external environment chooses its own prompts"),
        ({"inference": {"per_worker": True}}, "inference.per_worker: a trainer-only run has no rollout workers"),
        ({"env": {"id": "arithmetic"}}, "env.id: unknown key; remove it or use one of eval_id, eval_kwargs"),
        ({"env": {"group_size": 0}}, "env.group_size: Input should be greater than or equal to 1"),
    ],
)
def test_settings_a_trainer_only_run_cannot_use_are_named(sections: dict[str, Any], message: str) -> None:
    data = {"env": {"kind": "external"}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    with pytest.raises(RunConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(data)


def test_a_trainer_only_run_defaults_to_the_engine_the_server_and_grpo_and_reads_back() -> None:
    from rollhub.run.toml import dumps

    config = load_config({"env": {"kind": "external", "eval_id": "arithmetic"}, "eval": {"every": 5}})
    assert (config.policy.kind, config.writer.kind, config.trainer.kind) == ("hf", "server", "grpo")
    again = load_config(__import__("tomllib").loads(dumps(config.model_dump(mode="json"))))
    assert again == config  # a run directory's config.toml (every section written out) loads as the same run


def test_an_eval_environment_that_cannot_be_built_is_named(tmp_path: Path) -> None:
    from rollhub.run.group_parts import probe_group_env

    config = load_config({"env": {"kind": "external", "eval_id": "no.such.module:Env"}})
    with pytest.raises(RunConfigError, match=r"env\.eval_id"):
        probe_group_env(config)


def versioned_group(i: int) -> dict[str, Any]:
    """:func:`random_group` with per-token versions: every third one partial (its last token a version later),
    every third whole, every third without them (as from the completions route)."""
    group = random_group(i)
    kind = i % 3
    if kind == 2:
        return group
    row = [-1, -1, -1, 0, 0, 0 if kind == 1 else 1]
    return {**group, "token_versions": [row] * len(group["tokens"])}


def run_figures(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("rollhub_run_")
    }


def test_a_run_reports_partial_groups_version_spans_waits_and_engine_idle_on_the_server_and_in_its_summary(
    tmp_path: Path, server_factory: type[ServerProcess]
) -> None:
    server = server_factory("--storage", "memory", "--stamp-unversioned", "--max-staleness", "2").start()
    engine = FakeEngine()
    run_dir = tmp_path / "run"
    seen: dict[str, Any] = {}
    run = frozenset({("fleet", "ext")})

    def watch(env: AtroposLikeEnv) -> None:
        """Once the two batches the environment posted before holding are trained on and the engine was read
        busy and idle, the server's /metrics and dashboard hold them; then the environment goes on."""
        deadline = time.monotonic() + 240
        try:
            while time.monotonic() < deadline:
                figures = run_figures(server.url)
                groups = sum(v for (n, _), v in figures.items() if n == "rollhub_run_trained_groups_total")
                reads = [figures.get(("rollhub_run_engine_reads_total", run | {("engine", "0"), ("state", s)}), 0)
                         for s in ("idle", "busy")]  # fmt: skip
                if groups == 4 and figures.get(("rollhub_run_trainer_wait_seconds_count", run)) == 2 and min(reads):
                    seen["figures"] = figures
                    seen["dashboard"] = httpx.get(server.url + "/dashboard/data", timeout=10).json()
                    return
                time.sleep(0.2)
        finally:
            env.release.set()

    with Served(engine.app()) as served:
        sections = {"run": {"metrics_every_s": 0.2}, "writer": {"url": server.url}}
        config = load_config(external_config(run_dir, served.url, **sections))
        env = AtroposLikeEnv(run_dir, versioned_group, group_size=4, hold_after=4)
        env.start()
        watcher = threading.Thread(target=watch, args=(env,), daemon=True)
        watcher.start()
        try:
            assert execute(config) == 0
        finally:
            env.stop()  # the server outlives the run: the environment would post on
        watcher.join(60)
        env.join(60)
    assert not env.is_alive() and env.error is None, env.error
    assert "figures" in seen, "the server's /metrics never showed the two trained batches and the engine's reads"
    figures = seen["figures"]
    by_kind = {k: figures[("rollhub_run_trained_groups_total", run | {("versions", k)})] for k in KINDS}
    assert by_kind == {"partial": 2, "whole": 1, "unknown": 1}  # groups 0 to 3: partial, whole, unknown, partial
    assert figures[("rollhub_run_trained_samples_total", run | {("versions", "partial")})] == 8
    assert figures[("rollhub_run_partial_groups_ratio", run)] == pytest.approx(2 / 3)
    assert figures[("rollhub_run_group_version_span_bucket", run | {("le", "0")})] == 1
    assert figures[("rollhub_run_group_version_span_bucket", run | {("le", "1")})] == 3
    assert 0 < figures[("rollhub_run_engine_idle_fraction", run | {("engine", "0")})] < 1
    [fleet] = seen["dashboard"]["fleets"]
    assert fleet["fleet"] == "ext" and fleet["workers"] == []
    assert fleet["run"]["partial_groups_ratio"] == pytest.approx(2 / 3)
    assert 0 < fleet["run"]["engines"][0]["idle_fraction"] < 1

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    versions = summary["token_versions"]  # groups 0 to 5, oldest first
    assert versions["groups"] == {"partial": 2, "whole": 2, "unknown": 2, "partial_ratio": 0.5}
    assert versions["samples"] == {"partial": 8, "whole": 8, "unknown": 8, "partial_ratio": 0.5}
    assert versions["span_counts"] == {"0": 2, "1": 2} and versions["max_span"] == 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    waits = summary["trainer_wait_s"]
    assert waits["updates"] == 3 and waits["max"] == pytest.approx(max(r["wait_s"] for r in rows), abs=1e-4)
    assert waits["median"] <= waits["p95"] <= waits["max"]
    idle = summary["engine_idle"]
    assert idle["idle_reads"] >= 1 and idle["busy_reads"] >= 1 and 0 < idle["fraction"] < 1
    assert summary["server_stale_dropped"] is not None and summary["trainer_stale_groups"] == 0
