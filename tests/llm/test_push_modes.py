"""The weight push's modes against a fake engine: the calls each mode and KV policy makes, in order, the fallback
for an engine without ``keep``, and a restarted engine reloaded with the newest checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from engine_fakes import healthy_server

from rollhub.inference.engine import TOKEN_ROUTE_ARG, EngineError, route_args
from rollhub.weights.checkpoint import CheckpointDirectory
from rollhub.weights.engine import EngineWeightPublisher

WEIGHTS = {"lm_head.weight": np.ones((4, 3), np.float32)}


class Engine:
    """Records each dev-mode call as ``path?query``; ``keep`` mode answers 400 when ``has_keep`` is false."""

    def __init__(self, has_keep: bool = True) -> None:
        self.calls: list[str] = []
        self.has_keep = has_keep
        self.version = "default"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        query = request.url.query.decode()
        self.calls.append(f"{request.url.path}?{query}" if query else request.url.path)
        if request.url.path == "/pause" and "mode=keep" in query and not self.has_keep:
            return httpx.Response(400, json={"error": "Invalid pause mode: keep"})
        if request.url.path == "/update_weight_version":
            self.version = json.loads(request.content)["new_version"]
        return httpx.Response(200, json={})


def _publisher(tmp_path: Path, engines: list[Engine], **kwargs: object) -> EngineWeightPublisher:
    def route(request: httpx.Request) -> httpx.Response:
        return engines[int(request.url.host[-1])](request)

    urls = [f"http://engine{i}" for i in range(len(engines))]
    return EngineWeightPublisher(urls, CheckpointDirectory(tmp_path, 2), transport=httpx.MockTransport(route),
                                 **kwargs)  # type: ignore[arg-type]  # fmt: skip


RELOAD = ["/collective_rpc", "/update_weight_version"]


@pytest.mark.parametrize(
    ("mode", "kv", "calls"),
    [
        ("wait", "clear", ["/pause?mode=wait&clear_cache=true", *RELOAD, "/resume"]),
        ("wait", "keep", ["/pause?mode=wait&clear_cache=false", *RELOAD, "/resume"]),
        ("abort", "clear", ["/pause?mode=abort&clear_cache=true", *RELOAD, "/resume"]),
        ("keep", "clear", ["/pause?mode=keep", *RELOAD, "/reset_prefix_cache?reset_running_requests=true", "/resume"]),
        ("keep", "keep", ["/pause?mode=keep", *RELOAD, "/resume"]),
    ],
)
def test_each_mode_makes_its_calls_in_order(tmp_path: Path, mode: str, kv: str, calls: list[str]) -> None:
    engine = Engine()
    _publisher(tmp_path, [engine], mode=mode, kv=kv).publish(1, WEIGHTS)
    assert engine.calls == calls and engine.version == "1"


@pytest.mark.parametrize("fallback", ["wait", "abort"])
def test_an_engine_without_keep_is_pushed_in_the_fallback_mode_from_then_on(tmp_path: Path, fallback: str) -> None:
    old, new = Engine(has_keep=False), Engine()
    pub = _publisher(tmp_path, [old, new], mode="keep", fallback=fallback)
    pub.publish(1, WEIGHTS)
    pub.publish(2, WEIGHTS)
    assert old.calls[:2] == ["/pause?mode=keep", f"/pause?mode={fallback}&clear_cache=true"]
    assert old.calls[2:].count("/pause?mode=keep") == 0  # asked once, then never again
    assert new.calls.count("/pause?mode=keep") == 2 and old.version == new.version == "2"
    assert pub.modes == [fallback, "keep"] and pub.fallbacks == 1


def test_a_keep_push_that_fails_still_resumes_and_other_errors_are_not_fallbacks(tmp_path: Path) -> None:
    class Broken(Engine):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/pause":
                self.calls.append("/pause")
                return httpx.Response(500, json={"error": "boom"})
            return super().__call__(request)

    engine = Broken()
    pub = _publisher(tmp_path, [engine], mode="keep")
    with pytest.raises(EngineError, match="/pause answered 500"):
        pub.publish(1, WEIGHTS)
    assert pub.modes == ["keep"] and pub.fallbacks == 0


@pytest.mark.parametrize(("field", "value"), [("mode", "later"), ("kv", "maybe"), ("fallback", "keep")])
def test_an_unknown_setting_is_refused_by_name(tmp_path: Path, field: str, value: str) -> None:
    with pytest.raises(EngineError, match=f"push {field} '{value}' is not one of"):
        _publisher(tmp_path, [Engine()], **{field: value})


def test_a_restarted_engine_is_reloaded_with_the_newest_checkpoint(tmp_path: Path) -> None:
    engines = [Engine(), Engine()]
    pub = _publisher(tmp_path, engines)
    assert pub.reload(1) is None and engines[1].calls == []  # nothing pushed yet: the model's own weights
    pub.publish(3, WEIGHTS)
    pub.publish(4, {"lm_head.weight": np.full((4, 3), 2, np.float32)})
    restarted = Engine()
    engines[1] = restarted
    assert pub.reload(1) == 4
    assert restarted.calls == ["/pause?mode=wait&clear_cache=true", *RELOAD, "/resume"] and restarted.version == "4"
    assert [t.version for t in pub.timings] == [3, 4]  # a reload is not a new version


def test_a_run_s_inference_section_sets_the_push_and_the_route(tmp_path: Path) -> None:
    """``[inference] push, push_kv, push_fallback, route`` reach the publisher, the rollout clients and the
    command line of an engine the run starts (here the run reaches a stand-in engine at ``inference.url``)."""
    from rollhub.curriculum import CurriculumConfig, LessonConfig
    from rollhub.run.assemble import engine_backend
    from rollhub.run.config import load_config
    from rollhub.run.rundir import RunDirectory

    server = healthy_server()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    inference = {"url": url, "push": "abort", "push_kv": "keep", "route": "generate"}
    config = load_config({"env": {"kind": "group", "id": "mock"}, "policy": {"kind": "hf", "model": str(tmp_path)},
                          "inference": inference})  # fmt: skip
    try:
        backend = engine_backend(config, RunDirectory(tmp_path / "run"), note=lambda _: None)
        try:
            assert backend.publisher.modes == ["abort"] and backend.publisher.kv == "keep"
            factory = backend.manager_factory(
                CurriculumConfig([LessonConfig("mock", "rollhub.envs.group.mock:MockEnv")])
            )
            assert factory.route == "generate" and factory.continue_aborted
            assert backend._spec(RunDirectory(tmp_path / "run"), 0).args.count("--enable-scale-out") == 1
            assert backend.summary()["push_modes"] == ["abort"]
        finally:
            backend.close()
        default = load_config({"env": {"kind": "group", "id": "mock"}, "policy": {"kind": "hf"}}).inference
        assert (default.push, default.push_kv, default.push_fallback, default.route) == (
            "keep", "clear", "wait", "completions",
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()


def test_only_the_token_route_adds_its_engine_argument_and_never_twice() -> None:
    assert TOKEN_ROUTE_ARG == "--enable-scale-out"
    assert route_args("completions") == () and route_args("completions", ("--enforce-eager",)) == ()
    assert route_args("generate") == (TOKEN_ROUTE_ARG,) == route_args("generate", ("--enforce-eager",))
    assert route_args("generate", ("--enforce-eager", TOKEN_ROUTE_ARG)) == ()
