"""``rollhub demo tools``: a tiny Qwen2 learns to call a calculator tool, then answer, by GRPO sampled through vLLM.

The task (:class:`~rollhub.envs.episode.calculator.CalculatorEnv`) needs a tool and more than one turn: the user
asks ``a*b=?``; the model must call ``calc`` with ``a`` and ``b``, read the product back and answer it (an answer
without the tool earns nothing). Everything runs in this process, top to bottom:

1. A random tiny Qwen2 and a byte-level BPE tokenizer trained on the task's own text (no held-out problem in it)
   are built into the output directory, and a vLLM engine is started on them (``.venv-vllm``, ``make vllm``). The
   random model is evaluated: the *random-init baseline*.
2. **Warm start by demonstration.** From random weights the model never writes a whole call (about 29 tokens of
   JSON), so no reward ever comes. As real agent training starts from a model that already writes tool calls, the
   model is first fine-tuned (``--warm-steps`` steps of cross-entropy on its own turns only) on scripted episodes of
   the training problems (:func:`~rollhub.envs.episode.calculator.warm_start_groups`) that show three behaviours:
   a call with the question's operands (``--warm-right`` of them), an answer guessed without the tool
   (``--warm-guess``), and a slip, a call carrying the question's first operand twice; after a call the answer
   copies the tool's reply. The warm-started model writes calls and copies results, but samples each behaviour
   about as often as it was shown: the *warm-start baseline* solves about ``--warm-right`` of its episodes, and as
   the slip is shown twice as often as the right call, greedy decoding slips too.
3. **GRPO.** Each step samples groups of multi-turn episodes through the engine, takes one GRPO step on them and
   pushes the new weights into the engine. Its problems are drawn by how often the policy still fails them
   (:class:`~rollhub.envs.episode.prioritized.PrioritizedTasks`, ``--prioritize`` candidates per problem): a
   group that always succeeds teaches GRPO nothing. What is left to learn is which behaviour earns the reward: to
   call the tool, and with the question's operands. ``--operand-reward`` shapes the reward toward the operands (the
   calculator's ``operand_reward``). It stops at ``--target`` held-out accuracy, after ``--steps`` steps or after
   ``--max-seconds``.

**Held-out accuracy** is measured every ``--eval-every`` steps on problems (every tenth pair of ``2..--hi``, 33 of
324 at the default 19) that neither the warm start nor GRPO ever asks: ``--eval-samples`` episodes per held-out
problem, sampled as training samples them (temperature 1), and the share solved: the policy GRPO trains, every
behaviour it still samples counted. Greedy accuracy (one greedy episode per held-out problem, the likeliest behaviour
at every turn) is reported beside it as ``greedy_accuracy``. With operands up to 9 only (``--hi 9``: 57 training
problems), GRPO learns the training problems one by one faster than the rule, and held-out accuracy stalls once
every training group scores the same.

With ``--via-gateway`` the training episodes are not run by rollhub's episode loop: a capture gateway
(:mod:`rollhub.gateway`) is served in front of the engine, and a plain agent loop written against the ``openai``
client (open a session, chat with ``tools``, run the calls it gets back, answer, post the reward) plays each
episode; the gateway records the exact tokens and hands each finished group of sessions to the same trainer. The
held-out evaluation is the same in both modes.

Each step prints one line (mean episode score, the share of episodes with a right call, accuracy, turns, the
train-inference mismatch). ``curve.jsonl`` in ``--out-dir`` holds one line per evaluation (``step``,
``eval_accuracy``, ``greedy_accuracy``, ``eval_mean_reward``, ``train_mean_reward`` over the steps since the
last one, ``wall_s``). The last line of stdout is JSON: ``random_init_accuracy``, ``warm_start_accuracy``,
``eval_accuracy`` (the last evaluation), the same three as ``*_greedy_accuracy``, ``best_accuracy``,
``target_reached``, ``steps``, ``wall_s``, ``warm_start`` (its steps, seconds and loss), ``problems`` (how many
each split holds), and the first and last steps' lines.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np


def parser() -> argparse.ArgumentParser:
    """The demo's command line."""
    from rollhub.demos.options import plain

    p = argparse.ArgumentParser(prog="rollhub demo tools", description=plain(__doc__.splitlines()[0]))
    p.add_argument("--steps", type=int, default=300, help="most GRPO steps (300)")
    p.add_argument("--max-seconds", type=float, default=1500.0, help="stop after this long (1500)")
    p.add_argument("--target", type=float, default=0.9, help="stop at this held-out accuracy (0.9)")
    p.add_argument("--groups", type=int, default=8, help="tasks per step (8)")
    p.add_argument("--group-size", type=int, default=8, help="episodes per task (8)")
    p.add_argument("--hi", type=int, default=19, help="operands range over 2..HI (19)")
    p.add_argument("--lr", type=float, default=5e-4, help="GRPO's Adam learning rate (5e-4)")
    p.add_argument("--operand-reward", type=float, default=0.1,
                   help="shaping: reward per question operand a call carries, if unsolved (0.1)")  # fmt: skip
    p.add_argument("--malformed-reward", type=float, default=-0.05, help="reward of a malformed call (-0.05)")
    p.add_argument("--warm-steps", type=int, default=300, help="warm-start steps; 0: none (300)")
    p.add_argument("--warm-right", type=float, default=0.25,
                   help="share of demonstrations calling with the question's operands (0.25)")  # fmt: skip
    p.add_argument("--warm-guess", type=float, default=0.25,
                   help="share answering without the tool; the rest slip, calling calc(a, a) (0.25)")  # fmt: skip
    p.add_argument("--warm-batch", type=int, default=32, help="warm-start episodes per step (32)")
    p.add_argument("--warm-lr", type=float, default=3e-3, help="warm-start Adam learning rate (3e-3)")
    p.add_argument("--prioritize", type=int, default=4,
                   help="draw each training problem from K candidates, weighted by 1 - its recent success (4; "
                        "1: uniform)")  # fmt: skip
    p.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations (10)")
    p.add_argument("--eval-samples", type=int, default=4, help="sampled episodes per held-out problem (4)")
    p.add_argument("--via-gateway", action="store_true",
                   help="play the training episodes with OpenAI-client agents through the capture gateway")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the warm start and the sampling (0)")
    p.add_argument("--out-dir", type=Path, default=Path("rollhub-runs/tools"), help="model, weights, engine log, curve")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line."""
    return parser().parse_args(argv)


def solved(a: int, b: int) -> str:
    """A solved episode of ``a*b`` as the chat template writes it."""
    call = f'<tool_call>{{"name": "calc", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    return (f"system: tools calc(a, b)\nuser: {a}*{b}=?\nassistant: {call}\n"
            f"tool: <tool_response>{a * b}</tool_response>\nassistant: {a * b}\n")  # fmt: skip


def corpus(env: Any) -> tuple[str, ...]:
    """The texts the tokenizer is trained on: the digits, the template's words and a solved episode of every
    problem outside the held-out set (no held-out problem is in the tokenizer's training text)."""
    return ("0123456789\n", *(solved(a, b) for a, b in env.train_problems))


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when the target was reached, 1 when a limit came first or the engine failed."""
    import torch

    from rollhub.envs.episode import ChatRenderer, EpisodeGroupEnv, EpisodeLimits
    from rollhub.envs.episode.calculator import CalculatorEnv
    from rollhub.envs.episode.prioritized import PrioritizedTasks
    from rollhub.envs.episode.runner import episode_metrics, run_episodes
    from rollhub.inference.base import SamplingParams
    from rollhub.inference.engine import EngineError, EngineSpec, VLLMEngine
    from rollhub.inference.openai_client import OpenAICompletionsClient
    from rollhub.models import TinyModelSpec, build_tiny_model, load_causal_lm, load_tokenizer
    from rollhub.train.grpo import GRPOConfig, GRPOTrainer
    from rollhub.weights.checkpoint import CheckpointDirectory
    from rollhub.weights.engine import EngineWeightPublisher

    args = parse_args(argv)
    started = time.monotonic()
    # SIGTERM and SIGHUP end the demo as Ctrl-C does: the engine's context stops the engine instead of leaving it
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, _exit_on_signal)
    torch.set_num_threads(1)  # tiny matrices: more threads only add synchronisation beside the engine's
    task = CalculatorEnv(lo=2, hi=args.hi, malformed_reward=args.malformed_reward, operand_reward=args.operand_reward)
    spec = TinyModelSpec(corpus=corpus(task), all_bytes=False, vocab_size=160, num_key_value_heads=4,
                         intermediate_size=512, initializer_range=0.05, seed=args.seed)  # fmt: skip
    problems = {"train": len(task.train_problems), "eval": len(task.eval_problems)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(args.out_dir / "model", spec)
    engine_spec = EngineSpec(model=str(model_dir), max_model_len=256, kv_cache_gb=1,
                             log_path=args.out_dir / "vllm.log", ready_timeout_s=900)  # fmt: skip
    print(f"rollhub demo tools: starting vLLM on {model_dir} ...", file=sys.stderr, flush=True)
    try:
        engine = VLLMEngine.start(engine_spec)
    except EngineError as exc:
        print(f"rollhub demo tools: {exc}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(args.seed)
    with engine:
        client = OpenAICompletionsClient(engine.url, engine.spec.name, timeout_s=300, send_seed=False)
        limits = EpisodeLimits(max_tokens=240, turn_max_tokens=48, max_turns=3)
        renderer = ChatRenderer(load_tokenizer(str(model_dir)))
        env = EpisodeGroupEnv(PrioritizedTasks(task, args.prioritize), renderer, limits, SamplingParams())

        def evaluate() -> dict[str, float]:
            held_out = task.tasks(len(task.eval_problems), "eval", rng)
            sampled = episode_metrics(run_episodes(task, client, renderer, held_out, args.eval_samples, limits,
                                                   env.sampling, rng))  # fmt: skip
            greedy = env.sample(client, len(task.eval_problems), 1, "eval", rng)[1]
            return sampled | {"greedy_accuracy": greedy["accuracy"]}

        random_init = evaluate()
        print(f"eval random init: accuracy={random_init['accuracy']:.3g} "
              f"greedy={random_init['greedy_accuracy']:.3g}", flush=True)  # fmt: skip
        model = load_causal_lm(str(model_dir))
        warm = warm_start(model, task, renderer, task.train_problems, limits, args, rng)
        weights = args.out_dir / "weights"
        shutil.rmtree(weights, ignore_errors=True)  # a transport, not a record: versions restart with the engine
        publisher = EngineWeightPublisher([engine.url], CheckpointDirectory(weights, 2))
        trainer = GRPOTrainer(model, GRPOConfig(lr=args.lr), publish=publisher.publish)
        trainer.publish_current()  # version 0: the warm-started weights
        curve = Curve(args.out_dir / "curve.jsonl", started)
        evaluated = evaluate()
        warm_accuracy = evaluated["accuracy"]
        print(f"eval warm start: accuracy={warm_accuracy:.3g} greedy={evaluated['greedy_accuracy']:.3g}", flush=True)
        curve.add(0, evaluated)
        with rollout(args, env, client, task, limits, trainer) as sample:
            history, step = train(args, trainer, sample, evaluate, curve, started)
        client.close()
    first, last = history[0] if history else {}, history[-1] if history else {}
    best = max([warm_accuracy, *curve.accuracies])
    summary = {"random_init_accuracy": random_init["accuracy"], "warm_start_accuracy": warm_accuracy,
               "eval_accuracy": curve.accuracies[-1] if curve.accuracies else warm_accuracy,
               "random_init_greedy_accuracy": random_init["greedy_accuracy"],
               "warm_start_greedy_accuracy": evaluated["greedy_accuracy"], "eval_greedy_accuracy": curve.greedy,
               "best_accuracy": best, "target_reached": best >= args.target, "steps": step,
               "wall_s": round(time.monotonic() - started, 1), "mode": "gateway" if args.via_gateway else "in-process",
               "seed": args.seed, "warm_start": warm, "problems": problems, "curve": str(curve.path),
               "first": first, "last": last}  # fmt: skip
    print(json.dumps(summary))
    return 0 if summary["target_reached"] else 1


def _exit_on_signal(number: int, frame: Any) -> None:
    raise SystemExit(128 + number)


def warm_start(model: Any, task: Any, renderer: Any, problems: list[tuple[int, int]], limits: Any,
               args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:  # fmt: skip
    """Fine-tune ``model`` on ``args.warm_steps`` batches of fresh warm-start episodes; their figures."""
    from rollhub.envs.episode.calculator import warm_start_groups
    from rollhub.train.sft import SupervisedConfig, SupervisedTrainer

    began = time.monotonic()
    sft = SupervisedTrainer(model, SupervisedConfig(lr=args.warm_lr))
    losses = []
    for step in range(1, args.warm_steps + 1):
        groups = warm_start_groups(task, renderer, problems, args.warm_batch, limits, rng, args.warm_right,
                                   args.warm_guess)  # fmt: skip
        losses.append(sft.step(groups)["nll"])
        if step % 50 == 0 or step == args.warm_steps:
            print(f"warm start step={step} nll={np.mean(losses[-50:]):.3g}", flush=True)
    return {"steps": args.warm_steps, "seconds": round(time.monotonic() - began, 1),
            "nll_first": round(losses[0], 4) if losses else None,
            "nll_last": round(float(np.mean(losses[-10:])), 4) if losses else None}  # fmt: skip


Sample = Callable[[np.random.Generator], tuple[list[Any], dict[str, float]]]


def train(args: argparse.Namespace, trainer: Any, sample: Sample, evaluate: Callable[[], dict[str, float]],
          curve: Curve, started: float) -> tuple[list[dict[str, float]], int]:  # fmt: skip
    """GRPO steps until the target, ``--steps`` or ``--max-seconds``; each step's line, and the steps taken."""
    rng = np.random.default_rng(args.seed + 1)
    history: list[dict[str, float]] = []
    step = 0
    for step in range(1, args.steps + 1):
        groups, metrics = sample(rng)
        for g in groups:
            g.policy_version = trainer.policy_version
        stats = trainer.step(groups) if groups else {}
        line = {"step": step, "mean_reward": metrics["mean_reward"], "right_call_rate": metrics["right_call_rate"],
                "accuracy": metrics["accuracy"], "informative": metrics["informative_groups"],
                "solved_problems": metrics["tasks_solved"], "mean_turns": metrics["mean_turns"],
                "tool_errors": metrics["tool_errors"], "mismatch": stats.get("mismatch_abs", 0.0)}  # fmt: skip
        history.append(line)
        print(" ".join(f"{k}={v:.3g}" for k, v in line.items()), flush=True)
        out_of_time = time.monotonic() - started > args.max_seconds
        if step % args.eval_every == 0 or step == args.steps or out_of_time:
            evaluated = evaluate()
            since = history[-args.eval_every :]
            curve.add(step, evaluated, float(np.mean([h["mean_reward"] for h in since])))
            print(f"eval step={step} accuracy={evaluated['accuracy']:.3g} "
                  f"greedy={evaluated['greedy_accuracy']:.3g}", flush=True)  # fmt: skip
            if evaluated["accuracy"] >= args.target:
                break
        if out_of_time:
            break
    return history, step


class Curve:
    """The learning curve: one JSON line per held-out evaluation, written as it is measured."""

    def __init__(self, path: Path, started: float) -> None:
        self.path = path
        self.started = started
        self.accuracies: list[float] = []
        self.greedy: float | None = None  # the last evaluation's greedy accuracy
        path.write_text("")

    def add(self, step: int, evaluated: dict[str, float], train_reward: float | None = None) -> None:
        """Record the evaluation after ``step`` GRPO steps (0: the warm-started model)."""
        if step:
            self.accuracies.append(evaluated["accuracy"])
        self.greedy = evaluated["greedy_accuracy"]
        line = {"step": step, "eval_accuracy": evaluated["accuracy"], "greedy_accuracy": self.greedy,
                "eval_mean_reward": evaluated["mean_reward"],
                "train_mean_reward": train_reward, "wall_s": round(time.monotonic() - self.started, 1)}  # fmt: skip
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def right_calls(groups: list[Any]) -> float:
    """The share of episodes (rows: none forks with this template) that called ``calc`` for the right product."""
    from rollhub.envs.episode import parse_tool_calls
    from rollhub.envs.group.scored import INFO_KEY

    right = []
    for g in groups:
        a, b = g.meta["group_overrides"][INFO_KEY]["example_id"].split("*")
        for messages in g.meta["messages"]:
            calls = [c for m in messages if m["role"] == "assistant" for c in parse_tool_calls(m["content"])]
            right.append(any(c.name == "calc" and _product(c.arguments) == int(a) * int(b) for c in calls))
    return float(np.mean(right)) if right else 0.0


def _product(arguments: Any) -> int | None:
    try:
        return int(arguments["a"]) * int(arguments["b"])
    except (KeyError, TypeError, ValueError):
        return None


@contextmanager
def rollout(args: argparse.Namespace, env: Any, client: Any, task: Any, limits: Any,
            trainer: Any) -> Iterator[Sample]:  # fmt: skip
    """How a step's training episodes are played: rollhub's episode loop on the engine, or (``--via-gateway``)
    OpenAI-client agents through a capture gateway in front of it. Yields ``sample(rng) -> (groups, metrics)``."""
    if not args.via_gateway:

        def sample(rng: np.random.Generator) -> tuple[list[Any], dict[str, float]]:
            groups, metrics = env.sample(client, args.groups, args.group_size, "train", rng)
            return groups, metrics | {"right_call_rate": right_calls(groups)} | env.env.stats()

        yield sample
        return
    from rollhub.gateway import Gateway, GatewayConfig
    from rollhub.gateway.app import create_gateway_app
    from rollhub.inference.base import SamplingParams

    sent: list[Any] = []
    config = GatewayConfig(model=client.model, max_tokens=limits.max_tokens, turn_max_tokens=limits.turn_max_tokens,
                           sampling=SamplingParams(), env_name=task.name)  # fmt: skip
    gateway = Gateway([client], env.renderer, config, sent.extend)
    with serve_in_thread(create_gateway_app(gateway)) as url, ThreadPoolExecutor(16) as pool:
        import httpx

        http = httpx.Client(base_url=url, timeout=300)
        counter = iter(range(1 << 62))

        def sample(rng: np.random.Generator) -> tuple[list[Any], dict[str, float]]:
            http.post("/policy-version", json={"policy_version": trainer.policy_version}).raise_for_status()
            sent.clear()
            tasks = env.env.tasks(args.groups, "train", rng)
            jobs = []
            for t in tasks:
                key = f"step-{next(counter)}"
                for _ in range(args.group_size):
                    session = http.post("/sessions", json={"group": key, "group_size": args.group_size}).json()
                    jobs.append(pool.submit(play, http, session, t, client.model, limits, task.operand_reward))
            played = [j.result() for j in jobs]
            for t, p in zip([t for t in tasks for _ in range(args.group_size)], played, strict=True):
                env.env.record(t.id, p["correct"])
            n = max(len(played), 1)
            scores = [[p["reward"] for p in played[i : i + args.group_size]]
                      for i in range(0, len(played), args.group_size)]  # fmt: skip
            metrics = {
                "mean_reward": sum(p["reward"] for p in played) / n,
                "accuracy": sum(p["correct"] for p in played) / n,
                "right_call_rate": sum(p["right_call"] for p in played) / n,
                "mean_turns": sum(p["turns"] for p in played) / n,
                "tool_errors": sum(p["tool_errors"] for p in played) / n,
                "informative_groups": float(np.mean([np.ptp(g) > 0 for g in scores])) if scores else 0.0,
            }
            return list(sent), metrics | env.env.stats()

        try:
            yield sample
        finally:
            http.close()


def play(http: Any, session: dict[str, Any], task: Any, model: str, limits: Any,
         operand_reward: float) -> dict[str, Any]:  # fmt: skip
    """One episode by a plain agent loop on the ``openai`` client, pointed at the session's ``base_url``: chat with
    the calculator's tools, run each call it gets back, send the results, until a turn without a call (the answer);
    then post the task's reward (:func:`~rollhub.envs.episode.calculator.judge`) and finish the session."""
    import openai

    from rollhub.envs.episode.calculator import calc, judge, operands

    agent = openai.OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    messages: list[Any] = [dict(m) for m in task.messages]
    calls: list[tuple[int, int] | None] = []
    final, ended, turns, errors = "", False, 0, 0
    try:
        for _ in range(limits.max_turns):
            reply = agent.chat.completions.create(model=model, messages=messages, tools=list(task.tools),
                                                  max_tokens=limits.turn_max_tokens)  # fmt: skip
            turns += 1
            choice = reply.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if not choice.message.tool_calls:
                final, ended = choice.message.content or "", choice.finish_reason == "stop"
                break
            if choice.finish_reason != "tool_calls":  # cut at the turn's cap
                break
            for call in choice.message.tool_calls:
                try:
                    args = json.loads(call.function.arguments)
                    if call.function.name != "calc":
                        raise ValueError(f"no tool named {call.function.name!r}")
                    result = calc(**args)
                    calls.append((args["a"], args["b"]))
                except (TypeError, ValueError) as exc:
                    result, errors = f"error: {exc}", errors + 1
                    calls.append(None)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except openai.BadRequestError:  # the episode's token budget ran out
        pass
    finally:
        agent.close()
    outcome = judge(operands(task), calls, final, ended, operand_reward)
    http.post(f"/sessions/{session['session_id']}/finish",
              json={"reward": outcome.reward, "correct": outcome.correct}).raise_for_status()  # fmt: skip
    right = any(c is not None and c[0] * c[1] == task.data for c in calls)
    return {"reward": outcome.reward, "correct": outcome.correct, "right_call": right,
            "turns": turns, "tool_errors": errors}  # fmt: skip


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free loopback port in a thread; yields its URL, stops it after."""
    import uvicorn

    from rollhub.inference.engine import free_port

    port = free_port()
    # both ends live in this process: idle connections are kept for the whole run, so a request is never sent on one
    # the server is closing at that moment (uvicorn's 5 s default made that race reset a session's POST)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=3600)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="tools-gateway", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the gateway's server exited before it started")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()
