"""The engine path without an engine: the weight push against a fake engine, the version subscriber, the
manager factory's engine choice, engine process handling, and the config checks of a Hugging Face run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import torch

from rollhub.curriculum import CurriculumConfig, LessonConfig
from rollhub.errors import StopRequested
from rollhub.inference.engine import (
    ENGINE_SIDE,
    WORKER_EXTENSION,
    EngineDied,
    EngineError,
    EngineSpec,
    VLLMEngine,
    find_vllm_python,
)
from rollhub.run.config import RunConfigError, load_config
from rollhub.weights.checkpoint import CheckpointDirectory
from rollhub.weights.engine import IN_PLACE_METHOD, EngineVersionSubscriber, EngineWeightPublisher


class FakeEngine:
    """Answers the dev-mode routes like vLLM, records the calls, and can refuse one route."""

    def __init__(self, refuse: str | None = None, in_place: str = "yes") -> None:
        self.calls: list[str] = []
        self.methods: list[str] = []  # each /collective_rpc's method
        self.version = "default"
        self.refuse = refuse
        self.in_place = in_place  # "yes", "packed" (answers a refusal) or "unknown" (500, as without the extension)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append(path)
        if path == self.refuse:
            return httpx.Response(500, json={"error": "reload failed"})
        if path == "/update_weight_version":
            self.version = json.loads(request.content)["new_version"]
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.version})
        if path == "/collective_rpc":
            body = json.loads(request.content)
            self.methods.append(body["method"])
            assert body["method"] in (IN_PLACE_METHOD, "reload_weights")
            assert (Path(body["kwargs"]["weights_path"]) / "model.safetensors").is_file()
            if body["method"] == IN_PLACE_METHOD and self.in_place == "unknown":
                return httpx.Response(500, json={"error": f"Worker failed with error '{IN_PLACE_METHOD}'"})
            if body["method"] == IN_PLACE_METHOD and self.in_place == "packed":
                return httpx.Response(200, json={"results": [{"refused": "3 layers compute from packed copies"}]})
            return httpx.Response(200, json={"results": [{"tensors": 1}] if body["method"] == IN_PLACE_METHOD else []})
        return httpx.Response(200, json={})


def publisher(tmp_path: Path, engine: FakeEngine) -> EngineWeightPublisher:
    return EngineWeightPublisher(
        ["http://engine"], CheckpointDirectory(tmp_path, 2), transport=httpx.MockTransport(engine)
    )


WEIGHTS = {"lm_head.weight": np.ones((4, 3), np.float32)}


def test_a_push_pauses_reloads_sets_the_version_and_resumes(tmp_path: Path) -> None:
    engine = FakeEngine()
    pub = publisher(tmp_path, engine)
    sub = EngineVersionSubscriber("http://engine", transport=httpx.MockTransport(engine))
    sub.poll()
    assert sub.loaded_version is None  # vLLM's "default": no rollhub version yet
    pub.publish(0, WEIGHTS)
    pub.publish(1, WEIGHTS)
    assert engine.calls[:4] == ["/weight_info", "/pause", "/collective_rpc", "/update_weight_version"]
    assert engine.calls[4] == "/resume"
    assert sub.poll() is None and sub.loaded_version == 1 == sub.offered_version
    assert [t.version for t in pub.timings] == [0, 1] and pub.timings[0].nbytes == 48
    assert CheckpointDirectory(tmp_path).steps() == [0, 1]
    with pytest.raises(EngineError, match="version 1 is not newer"):
        pub.publish(1, WEIGHTS)


def test_a_failed_reload_still_resumes_the_engine(tmp_path: Path) -> None:
    engine = FakeEngine(refuse="/collective_rpc")
    with pytest.raises(EngineError, match=r"/collective_rpc answered 500"):
        publisher(tmp_path, engine).publish(0, WEIGHTS)
    assert engine.calls == ["/pause", "/collective_rpc", "/collective_rpc", "/resume"]  # in place, then reload
    assert engine.version == "default"


def test_a_push_loads_in_place_where_the_engine_takes_it(tmp_path: Path) -> None:
    engine = FakeEngine()
    pub = publisher(tmp_path, engine)
    pub.publish(0, WEIGHTS)
    pub.publish(1, WEIGHTS)
    assert engine.methods == [IN_PLACE_METHOD] * 2 and pub.loads == ["in_place"] and pub.load_fallbacks == []


@pytest.mark.parametrize(("in_place", "why"), [("packed", "packed copies"), ("unknown", "answered 500")])
def test_an_engine_that_refuses_the_in_place_load_is_reloaded_from_then_on(tmp_path: Path, in_place: str,
                                                                           why: str) -> None:  # fmt: skip
    engine = FakeEngine(in_place=in_place)
    pub = publisher(tmp_path, engine)
    pub.publish(0, WEIGHTS)
    pub.publish(1, WEIGHTS)
    assert engine.methods == [IN_PLACE_METHOD, "reload_weights", "reload_weights"]
    assert pub.loads == ["reload"] and len(pub.load_fallbacks) == 1 and why in pub.load_fallbacks[0]
    assert engine.version == "1"


def test_the_reload_after_a_refusal_is_sent_again_on_a_new_connection_if_the_old_one_was_closed(
    tmp_path: Path,
) -> None:
    """vLLM answers an unknown method with a 500 from an unhandled exception and closes the connection."""
    engine = FakeEngine(in_place="unknown")
    resets = [1]

    def transport(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/collective_rpc" and engine.methods == [IN_PLACE_METHOD] and resets:
            resets.pop()
            raise httpx.ReadError("Connection reset by peer")
        return engine(request)

    pub = EngineWeightPublisher(["http://engine"], CheckpointDirectory(tmp_path, 2),
                                transport=httpx.MockTransport(transport))  # fmt: skip
    pub.publish(0, WEIGHTS)
    assert engine.methods == [IN_PLACE_METHOD, "reload_weights"] and not resets and engine.version == "0"


def test_load_reload_never_asks_for_the_in_place_load_and_a_bad_load_is_named(tmp_path: Path) -> None:
    engine = FakeEngine()
    pub = EngineWeightPublisher(["http://engine"], CheckpointDirectory(tmp_path, 2), load="reload",
                                transport=httpx.MockTransport(engine))  # fmt: skip
    pub.publish(0, WEIGHTS)
    assert engine.methods == ["reload_weights"] and pub.load_fallbacks == []
    with pytest.raises(EngineError, match="load 'copy' is not one of in_place, reload"):
        EngineWeightPublisher(["http://engine"], CheckpointDirectory(tmp_path, 2), load="copy")  # type: ignore[arg-type]


def test_a_server_without_dev_mode_is_named(tmp_path: Path) -> None:
    engine_404 = httpx.MockTransport(lambda r: httpx.Response(404, json={"detail": "Not Found"}))
    pub = EngineWeightPublisher(["http://engine"], CheckpointDirectory(tmp_path, 2), transport=engine_404)
    with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1"):
        pub.publish(0, WEIGHTS)


def test_a_foreign_weight_version_is_refused() -> None:
    engine = FakeEngine()
    engine.version = "step-abc"
    with pytest.raises(EngineError, match="not a rollhub version"):
        EngineVersionSubscriber("http://engine", transport=httpx.MockTransport(engine)).poll()


def test_manager_factory_spreads_workers_over_engines() -> None:
    from rollhub.run.llm import EngineManagerFactory

    curriculum = CurriculumConfig(lessons=(LessonConfig("add", "arithmetic", {}),))
    factory = EngineManagerFactory(curriculum, ("http://a", "http://b"), "m")
    assert [factory.url(w) for w in ("w0", "w1", "w2", "w1r3", "local-0", "eval")] == [
        "http://a", "http://b", "http://a", "http://b", "http://a", "http://a",
    ]  # fmt: skip
    assert factory.subscriber("w1").url == "http://b"


def test_an_engine_process_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    """A stand-in interpreter that prints and exits: the error names the process and ends with its log."""
    script = tmp_path / "fake-python"
    script.write_text("#!/bin/sh\necho 'cannot load the model' >&2\nexit 3\n")
    script.chmod(0o755)
    spec = EngineSpec(model=str(tmp_path), python=str(script), ready_timeout_s=60, log_path=tmp_path / "e.log")
    with pytest.raises(EngineDied, match=r"(?s)exited with code 3.*cannot load the model"):
        VLLMEngine.start(spec)


def test_an_engine_that_never_answers_times_out_and_is_stopped(tmp_path: Path) -> None:
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import time; time.sleep(600)'\n")
    script.chmod(0o755)
    spec = EngineSpec(model=str(tmp_path), python=str(script), ready_timeout_s=1, log_path=tmp_path / "e.log")
    engine = VLLMEngine.start(spec, wait=False)
    with pytest.raises(EngineError, match="not ready within 1 s"):
        engine.wait_until_ready(1)
    engine.stop(timeout_s=30)
    assert engine.process.poll() is not None


def test_the_engine_environment_enables_the_push_routes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = EngineSpec(model=str(tmp_path), kv_cache_gb=1.6, env={"EXTRA": "1"}).environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["EXTRA"] == "1"
    assert env["PYTHONPATH"] == str(ENGINE_SIDE)  # only the worker extension's directory, not the caller's path
    mine = EngineSpec(model=str(tmp_path), env={"PYTHONPATH": "/my/plugins"}).environment()["PYTHONPATH"]
    assert mine == f"{ENGINE_SIDE}:/my/plugins"  # a path given for the engine keeps the extension reachable
    assert (ENGINE_SIDE / f"{WORKER_EXTENSION.split('.')[0]}.py").is_file()
    assert "HF_HUB_OFFLINE" not in EngineSpec(model="org/some-model").environment()  # a hub name may download


def test_a_missing_interpreter_is_named() -> None:
    with pytest.raises(EngineError, match=r"inference.python '/nowhere/python' does not exist"):
        find_vllm_python("/nowhere/python")


GROUP_RUN = {
    "env": {"kind": "group", "id": "arithmetic", "kwargs": {"max_operand": 9}},
    "policy": {"kind": "hf", "model": "tiny"},
}


def test_an_hf_run_config_loads_with_engine_defaults() -> None:
    config = load_config(GROUP_RUN)
    assert config.policy.kind == "hf" and config.inference.kind == "vllm" and config.inference.url is None
    assert config.writer.kind == "in_process" and config.trainer.kind == "grpo"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"inference": {"url": "http://x", "per_worker": True}}, "inference.per_worker"),
        ({"policy": {"kind": "hf", "model": "/m", "tiny": {"hidden_size": 64}}}, "policy.tiny"),
        ({"policy": {"kind": "hf", "dtype": "int8"}}, "policy.dtype"),
        ({"inference": {"kind": "sglang"}}, "inference.kind"),
        ({"inference": {"kv_cache_gb": 0}}, "inference.kv_cache_gb"),
        ({"inference": {"worker_spin_s": -0.1}}, "inference.worker_spin_s"),
        ({"inference": {"worker_spin_s": True}}, "inference.worker_spin_s"),
    ],
)
def test_bad_hf_settings_are_named(extra: dict, message: str) -> None:
    with pytest.raises(RunConfigError, match=message):
        load_config({**GROUP_RUN, **extra})


def test_kv_cache_false_leaves_it_to_vllm_and_survives_the_written_config() -> None:
    import tomllib

    from rollhub.run.toml import dumps

    config = load_config({**GROUP_RUN, "inference": {"kv_cache_gb": False}})
    assert config.inference.kv_cache_gb is None
    again = load_config(tomllib.loads(dumps(config.model_dump(mode="json"))))
    assert again.inference == config.inference
    with pytest.raises(RunConfigError, match=r"inference\.kv_cache_gb"):
        load_config({**GROUP_RUN, "inference": {"kv_cache_gb": True}})


def test_the_spin_cap_reaches_the_engines_spec_and_false_leaves_vllms_own(tmp_path: Path) -> None:
    import tomllib

    from rollhub.inference.engine import DEFAULT_SPIN_S
    from rollhub.run.llm import EngineBackend
    from rollhub.run.rundir import RunDirectory
    from rollhub.run.toml import dumps

    for given, expected in ((None, DEFAULT_SPIN_S), (0.02, 0.02), (False, None)):
        inference = {} if given is None else {"worker_spin_s": given}
        config = load_config({**GROUP_RUN, "inference": inference})
        assert config.inference.worker_spin_s == expected
        again = load_config(tomllib.loads(dumps(config.model_dump(mode="json"))))
        assert again.inference == config.inference  # the run directory's config.toml reads back the same
        backend = EngineBackend.__new__(EngineBackend)  # only _spec's inputs: no engine started
        backend.inference, backend.policy, backend.model = config.inference, config.policy, "/m"
        assert backend._spec(RunDirectory(tmp_path / "run"), 0).spin_s == expected


def test_an_engine_section_without_an_hf_policy_is_refused() -> None:
    data = {**GROUP_RUN, "policy": {"kind": "transformer"}, "inference": {"kv_cache_gb": 2}}
    with pytest.raises(RunConfigError, match=r"inference: only a policy.kind = 'hf' run"):
        load_config(data)


def test_a_tiny_spec_that_cannot_build_is_named(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from rollhub.run.llm import model_directory
    from rollhub.run.rundir import RunDirectory

    config = load_config({**GROUP_RUN, "policy": {"kind": "hf", "tiny": {"hidden_size": 130}}})
    with pytest.raises(RunConfigError, match=r"policy.tiny: .*num_attention_heads"):
        model_directory(config.policy, config.run.seed, RunDirectory(tmp_path))
    config = load_config({**GROUP_RUN, "policy": {"kind": "hf", "tiny": {"layers": 3}}})
    with pytest.raises(RunConfigError, match=r"policy.tiny: .*layers"):
        model_directory(config.policy, config.run.seed, RunDirectory(tmp_path))


def test_score_reads_vllm_prompt_logprobs() -> None:
    from rollhub.inference.openai_client import InferenceError, OpenAICompletionsClient

    def engine(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["prompt"] == [[1, 5, 6], [1, 7]] and body["prompt_logprobs"] == 0
        choices = [
            {"index": 1, "prompt_logprobs": [None, {"7": {"logprob": -0.5, "rank": 1}}]},
            {"index": 0, "prompt_logprobs": [None, {"5": {"logprob": -1.0}, "9": {"logprob": -0.1}},
                                             {"6": {"logprob": -2.0}}]},
        ]  # fmt: skip
        return httpx.Response(200, json={"choices": choices})

    client = OpenAICompletionsClient("http://engine", "m", transport=httpx.MockTransport(engine))
    assert client.score([[1, 5, 6], [1, 7]]) == [[None, -1.0, -2.0], [None, -0.5]]
    broken = OpenAICompletionsClient(
        "http://engine",
        "m",
        transport=httpx.MockTransport(lambda r: httpx.Response(200, json={"choices": [{"index": 0}]})),
    )
    with pytest.raises(InferenceError, match="prompt_logprobs"):
        broken.score([[1, 2]])


class ShiftedSampler:
    """Samples with the local policy (token-id prompts) and reports its log-probs plus ``delta``: what an engine
    whose log-probs are off by ``delta`` returns."""

    def __init__(self, policy, delta: float) -> None:
        self.policy, self.delta = policy, delta

    def complete(self, prompts: list[list[int]], n: int, params, rng) -> list:
        from dataclasses import replace

        texts = [self.policy.tokenizer.decode(ids) for ids in prompts]
        out = self.policy.complete(texts, n, params, rng)
        return [[replace(c, logprobs=tuple(x + self.delta for x in c.logprobs)) for c in comps] for comps in out]


@pytest.mark.parametrize("settings", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5, "top_p": 0.9}])
def test_the_probe_samples_at_the_batch_settings_and_measures_the_gap(settings: dict) -> None:
    """The probe has the engine sample at the training batch's settings: against a sampler that stores its own
    processed log-probs (the local policy), the trainer's log-probs of the same distribution agree; off by
    ``delta``, the gap and its k3 are exactly those of ``delta``."""
    from rollhub.inference.tokenizer import CharTokenizer
    from rollhub.inference.torch_policy import LocalPolicy, TinyTransformer, TransformerConfig
    from rollhub.run.probe import probe_mismatch, probe_params

    torch.manual_seed(0)
    tokenizer = CharTokenizer()
    model = TinyTransformer(TransformerConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_heads=2)).eval()
    policy = LocalPolicy(model, tokenizer)
    prompts = [tokenizer.encode("12+3=", bos=True), tokenizer.encode("7=", bos=True)]
    params = probe_params({**settings, "max_tokens": 4})
    assert (params.temperature, params.max_tokens) == (settings["temperature"], 4)
    same = probe_mismatch(model, ShiftedSampler(policy, 0.0), prompts, params)
    assert same["probe_mismatch_abs"] < 1e-5 and same["probe_outside_support"] == 0.0
    shifted = probe_mismatch(model, ShiftedSampler(policy, 0.25), prompts, params)
    assert 2 <= shifted["probe_tokens"] <= 8
    assert shifted["probe_mismatch_abs"] == pytest.approx(0.25, abs=1e-5)
    assert shifted["probe_mismatch_kl"] == pytest.approx(np.expm1(-0.25) + 0.25, abs=1e-5)
    assert probe_mismatch(model, ShiftedSampler(policy, 0.0), [], params) == {}


def test_a_stop_request_while_the_engine_starts_stops_it_and_says_so(tmp_path: Path) -> None:
    pid_file = tmp_path / "engine.pid"
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec {sys.executable} -c 'import time; time.sleep(600)'\n")
    script.chmod(0o755)
    spec = EngineSpec(model=str(tmp_path), python=str(script), ready_timeout_s=600, log_path=tmp_path / "e.log")
    asked = []

    def stop() -> bool:  # a stop is requested once the engine process is up
        asked.append(1)
        return pid_file.exists() and pid_file.read_text().strip().isdigit()

    with pytest.raises(StopRequested, match=r"stopped while vLLM engine pid .* was starting"):
        VLLMEngine.start(spec, stop=stop)
    pid = int(pid_file.read_text())
    assert asked and (not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
