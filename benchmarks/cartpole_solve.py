"""Time and environment steps to solve CartPole-v1: ``rollhub demo cartpole`` next to Stable-Baselines3's PPO.

``rollhub`` is the demo as shipped (the local fleet: one worker thread in the trainer's process, no Ray);
``rollhub_ray`` is the same config on the Ray fleet (``--set fleet.backend='ray'``), for the cost of Ray's start.

Solved means: the mean return of the last 20 finished episodes (over all environments) is >= 475, the stop
rule of ``rollhub demo cartpole``. The reference is SB3's PPO with the rl-zoo CartPole-v1 hyperparameters
(8 environments, n_steps 32, batch_size 256, gae_lambda 0.8, gamma 0.98, n_epochs 20, ent_coef 0, learning
rate and clip range linear from 1e-3 and 0.2 to 0 over 1e5 steps), stopped by a callback at the same rule.

Run: ``python benchmarks/cartpole_solve.py [--seeds 3] [--no-ray] [--json]`` (``make bench-solve``). Runs
alternate (rollhub seed 0, SB3 seed 0, rollhub_ray seed 0, rollhub seed 1, ...), each a fresh subprocess, one at
a time; ``--no-ray`` leaves the Ray fleet out, for many seeds in less time.
Per tool it prints the median and range of:

* ``command_s``: the whole command, from launch to exit (start-up, training, shutdown);
* ``solve_s``: from training start to solved (rollhub: the summary's ``wall_s``, which holds building the
  learner and starting the fleet; SB3: from the start of ``learn()``, after its model and optimizer are built);
  for rollhub also ``after_first_update_s``: from the end of the first update to solved (the
  ``elapsed_s`` of the first and last rows of ``metrics.jsonl``), which leaves out the fleet's start-up;
* ``env_steps``: environment steps taken until solved.

With ``--json`` a last line holds one JSON object with the medians and the rollhub/SB3 ratios.
The SB3 side needs ``pip install -e '.[bench]'`` (stable-baselines3).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGET = 475.0
WINDOW = 20
SB3_HORIZON = 100_000  # the rl-zoo budget; its schedules reach 0 there, so an unsolved run stops there


def sb3_missing() -> str | None:
    """A message saying how to install stable-baselines3 when it cannot be imported, else ``None``."""
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        return "stable-baselines3 is not installed; run: pip install -e '.[bench]' (or make bench-solve)"
    return None


def sb3_child(seed: int, result: Path) -> None:
    """Train SB3 PPO (rl-zoo CartPole-v1 settings) until solved; write the figures to ``result`` as JSON."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)

    class SolvedStop(BaseCallback):
        """Stops learning once the mean return of the last ``WINDOW`` finished episodes reaches ``TARGET``."""

        def __init__(self) -> None:
            super().__init__()
            self.returns: deque[float] = deque(maxlen=WINDOW)
            self.solved_at: int | None = None

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.returns.append(float(info["episode"]["r"]))
            if len(self.returns) == WINDOW and sum(self.returns) / WINDOW >= TARGET:
                self.solved_at = self.num_timesteps
                return False
            return True

    def linear(start: float) -> Callable[[float], float]:
        """SB3's schedules are callables of the remaining progress (1 at the start, 0 at the end)."""
        return lambda remaining: remaining * start

    env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
    model = PPO(
        "MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0,
        learning_rate=linear(1e-3), clip_range=linear(0.2), seed=seed, device="cpu", verbose=0,
    )  # fmt: skip
    stop = SolvedStop()
    start = time.perf_counter()
    model.learn(total_timesteps=SB3_HORIZON, callback=stop)
    solve_s = time.perf_counter() - start
    figures = {"solved": stop.solved_at is not None, "env_steps": model.num_timesteps, "solve_s": solve_s}
    result.write_text(json.dumps(figures))


def run_sb3(seed: int, work: Path) -> dict[str, Any]:
    """One SB3 run in a fresh subprocess (this file in child mode)."""
    result = work / f"sb3-s{seed}.json"
    cmd = [sys.executable, __file__, "--sb3-child", str(seed), "--result", str(result)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    command_s = time.perf_counter() - start
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"SB3 seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(result.read_text()) | {"command_s": command_s}


def run_rollhub(seed: int, work: Path, backend: str | None = None) -> dict[str, Any]:
    """One ``rollhub demo cartpole`` run in a fresh subprocess (on ``backend`` when given, else the shipped
    one); its summary and metrics give the figures."""
    name = f"rollhub-{backend or 'shipped'}-s{seed}"
    out, summary_path = work / name, work / f"{name}.json"
    cmd = [sys.executable, "-m", "rollhub", "demo", "cartpole", "--seed", str(seed), "--out-dir", str(out)]
    cmd += ["--no-progress", "--summary-json", str(summary_path)]
    cmd += [] if backend is None else ["--set", f"fleet.backend={backend!r}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    command_s = time.perf_counter() - start
    if not summary_path.exists():
        raise RuntimeError(f"rollhub seed {seed} wrote no summary (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads(summary_path.read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    after_first = rows[-1]["elapsed_s"] - rows[0]["elapsed_s"] if rows else float("nan")
    return {
        "solved": summary["stop_reason"] == "target reached",
        "env_steps": summary["env_steps"],
        "solve_s": summary["wall_s"],
        "after_first_update_s": after_first,
        "command_s": command_s,
    }


def spread(values: list[float]) -> tuple[float, float, float]:
    """Median, minimum and maximum."""
    return statistics.median(values), min(values), max(values)


def table(results: dict[str, list[dict[str, Any]]]) -> tuple[str, dict[str, float]]:
    """The printed table and the medians (``<tool>_<figure>_median``) for the JSON line."""
    lines = [f"{'tool':11} {'figure':22} {'median':>10} {'min':>10} {'max':>10}   per seed"]
    medians: dict[str, float] = {}
    for tool, runs in results.items():
        keys = ["command_s", "solve_s", *(["after_first_update_s"] if tool != "sb3" else []), "env_steps"]
        for key in keys:
            values = [float(r[key]) for r in runs]
            med, low, high = spread(values)
            medians[f"{tool}_{key}_median"] = med
            each = ", ".join(f"{v:.0f}" if key == "env_steps" else f"{v:.1f}" for v in values)
            lines.append(f"{tool:11} {key:22} {med:10.1f} {low:10.1f} {high:10.1f}   {each}")
        unsolved = [i for i, r in enumerate(runs) if not r["solved"]]
        if unsolved:
            lines.append(f"{tool:11} NOT SOLVED in runs {unsolved} (their figures are where they stopped)")
    return "\n".join(lines), medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="runs per tool, seeds 0..N-1 (>= 1; default 3)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of medians and ratios")
    parser.add_argument("--work-dir", type=Path, default=None, help="where runs write (default: a temp dir)")
    parser.add_argument("--no-ray", action="store_true", help="leave out the rollhub_ray runs (many seeds sooner)")
    parser.add_argument("--sb3-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sb3_child is not None:
        sb3_child(args.sb3_child, args.result)
        return 0
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1 (got {args.seeds})")
    if (missing := sb3_missing()) is not None:
        print(missing, file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="cartpole-solve-"))
    work.mkdir(parents=True, exist_ok=True)
    tools: dict[str, Callable[[int, Path], dict[str, Any]]] = {"rollhub": run_rollhub, "sb3": run_sb3}
    if not args.no_ray:
        tools["rollhub_ray"] = functools.partial(run_rollhub, backend="ray")
    results: dict[str, list[dict[str, Any]]] = {tool: [] for tool in tools}
    for seed in range(args.seeds):
        for tool, run in tools.items():
            figures = run(seed, work)
            results[tool].append(figures)
            shown = {k: v if isinstance(v, bool) else round(v, 2) for k, v in figures.items()}
            print(f"{tool} seed {seed}: " + json.dumps(shown), flush=True)
    text, medians = table(results)
    print(text)
    if args.json:
        ratios = {
            f"ratio_{key}": medians[f"rollhub_{key}_median"] / medians[f"sb3_{key}_median"]
            for key in ("command_s", "solve_s", "env_steps")
        }
        if "rollhub_ray" in results:
            ratios |= {
                f"ratio_ray_{key}": medians[f"rollhub_ray_{key}_median"] / medians[f"sb3_{key}_median"]
                for key in ("command_s", "solve_s")
            }
        print(json.dumps({k: round(v, 3) for k, v in (medians | ratios).items()} | {"seeds": args.seeds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
