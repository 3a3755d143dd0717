"""``rollhub demo tools``: a tiny Qwen2 learns to call a calculator tool, then answer, by GRPO sampled through vLLM.

Everything runs in this process, top to bottom: a random tiny Qwen2 with a byte-level BPE tokenizer trained on the
task's own text (the chat template's words and a solved episode of every problem, so a tool call is a handful of
tokens) is built into the output directory; a vLLM engine is started on it (``.venv-vllm``, ``make vllm``); then
each step samples groups of multi-turn episodes of :class:`~rollhub.envs.episode.calculator.CalculatorEnv` through
the engine (the model must call ``calc`` for ``a*b``, read the product back and answer it), takes one GRPO step on
them and pushes the new weights into the engine. Every ``--eval-every`` steps every held-out problem is decoded
greedily.

Each step prints one line (mean episode score, the share of episodes with a right call, accuracy, turns, the
train-inference mismatch). The last line of stdout is JSON: ``steps``, ``wall_s``, ``eval_accuracy``, the first
and last steps' ``mean_reward`` and ``right_call_rate``.

What it reaches: the pipeline runs end to end (the engine's ids, episodes, GRPO, weight pushes, a mismatch near
1e-7 in float32), but from random weights the tiny model does not write a whole call (about 29 tokens of JSON with
this tokenizer) in a short run, so the reward stays at 0 and nothing is learned. A model that already writes tool
calls (a chat model, or one fine-tuned on solved episodes first) is what this loop trains.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def parser() -> argparse.ArgumentParser:
    """The demo's command line."""
    from rollhub.demos.options import plain

    p = argparse.ArgumentParser(prog="rollhub demo tools", description=plain(__doc__.splitlines()[0]))
    p.add_argument("--steps", type=int, default=200, help="GRPO steps (200)")
    p.add_argument("--max-seconds", type=float, default=1200.0, help="stop after this long (1200)")
    p.add_argument("--groups", type=int, default=8, help="tasks per step (8)")
    p.add_argument("--group-size", type=int, default=8, help="episodes per task (8)")
    p.add_argument("--hi", type=int, default=5, help="operands range over 2..HI (5)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (3e-3)")
    p.add_argument("--eval-every", type=int, default=20, help="steps between greedy evaluations (20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the sampling (0)")
    p.add_argument("--out-dir", type=Path, default=Path("rollhub-runs/tools"), help="model, weights, engine log")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line."""
    return parser().parse_args(argv)


def corpus(env: Any) -> tuple[str, ...]:
    """The texts the tokenizer is trained on: the template's words and a solved episode of every problem."""
    solved = []
    for a, b in [*env.train_problems, *env.eval_problems]:
        call = f'<tool_call>{{"name": "calc", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
        solved.append(f"system: tools calc(a, b)\nuser: {a}*{b}=?\nassistant: {call}\n"
                      f"tool: <tool_response>{a * b}</tool_response>\nassistant: {a * b}\n")  # fmt: skip
    return tuple(solved)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when it ran its steps (whatever it reached), 1 when the engine failed."""
    from rollhub.envs.episode import ChatRenderer, EpisodeGroupEnv, EpisodeLimits
    from rollhub.envs.episode.calculator import CalculatorEnv
    from rollhub.inference.base import SamplingParams
    from rollhub.inference.engine import EngineError, EngineSpec, VLLMEngine
    from rollhub.inference.openai_client import OpenAICompletionsClient
    from rollhub.models import TinyModelSpec, build_tiny_model, load_causal_lm, load_tokenizer
    from rollhub.train.grpo import GRPOConfig, GRPOTrainer
    from rollhub.weights.checkpoint import CheckpointDirectory
    from rollhub.weights.engine import EngineWeightPublisher

    args = parse_args(argv)
    started = time.monotonic()
    task = CalculatorEnv(lo=2, hi=args.hi, malformed_reward=-0.05)
    spec = TinyModelSpec(corpus=corpus(task), all_bytes=False, vocab_size=160, num_key_value_heads=4,
                         intermediate_size=512, initializer_range=0.05, seed=args.seed)  # fmt: skip
    model_dir = build_tiny_model(args.out_dir / "model", spec)
    engine_spec = EngineSpec(model=str(model_dir), max_model_len=256, kv_cache_gb=1,
                             log_path=args.out_dir / "vllm.log", ready_timeout_s=900)  # fmt: skip
    print(f"rollhub demo tools: starting vLLM on {model_dir} ...", file=sys.stderr, flush=True)
    try:
        engine = VLLMEngine.start(engine_spec)
    except EngineError as exc:
        print(f"rollhub demo tools: {exc}", file=sys.stderr)
        return 1
    with engine:
        client = OpenAICompletionsClient(engine.url, engine.spec.name, timeout_s=300, send_seed=False)
        limits = EpisodeLimits(max_tokens=240, turn_max_tokens=48, max_turns=3)
        env = EpisodeGroupEnv(task, ChatRenderer(load_tokenizer(str(model_dir))), limits, SamplingParams())
        weights = args.out_dir / "weights"
        shutil.rmtree(weights, ignore_errors=True)  # a transport, not a record: versions restart with the engine
        publisher = EngineWeightPublisher([engine.url], CheckpointDirectory(weights, 2))
        trainer = GRPOTrainer(load_causal_lm(str(model_dir)), GRPOConfig(lr=args.lr, entropy_coef=0.01),
                              publish=publisher.publish)  # fmt: skip
        trainer.publish_current()
        rng = np.random.default_rng(args.seed)
        history: list[dict[str, float]] = []
        accuracy = None
        step = 0
        for step in range(1, args.steps + 1):
            groups, metrics = env.sample(client, args.groups, args.group_size, "train", rng)
            for g in groups:
                g.policy_version = trainer.policy_version
            right_calls = float(np.mean([ep_right(g) for g in groups])) if groups else 0.0
            stats = trainer.step(groups) if groups else {}
            line = {"step": step, "mean_reward": metrics["mean_reward"], "right_call_rate": right_calls,
                    "accuracy": metrics["accuracy"], "mean_turns": metrics["mean_turns"],
                    "tool_errors": metrics["tool_errors"], "mismatch": stats.get("mismatch_abs", 0.0)}  # fmt: skip
            history.append(line)
            print(" ".join(f"{k}={v:.3g}" for k, v in line.items()), flush=True)
            if step % args.eval_every == 0 or step == args.steps:
                _, evaluated = env.sample(client, len(task.eval_problems), 1, "eval", rng)
                accuracy = evaluated["accuracy"]
                print(f"eval step={step} accuracy={accuracy:.3g}", flush=True)
            if time.monotonic() - started > args.max_seconds:
                break
        client.close()
    first, last = history[0] if history else {}, history[-1] if history else {}
    summary = {"steps": step, "wall_s": round(time.monotonic() - started, 1), "eval_accuracy": accuracy,
               "first": first, "last": last}  # fmt: skip
    print(json.dumps(summary))
    return 0


def ep_right(group: Any) -> float:
    """The share of the group's episodes whose score shows a right ``calc`` call (any reward above 0)."""
    return float(np.mean(group.scores > 0))
