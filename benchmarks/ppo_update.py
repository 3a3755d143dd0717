"""One PPO update of the CartPole demo: rollhub's ``PPOLearner.update`` next to Stable-Baselines3's ``PPO.train``.

Both train the same network (separate 64x64 tanh MLPs for the policy and the value, 4 observations, 2 actions)
with the same work per update: 512 samples, 20 epochs of 256-sample minibatches (40 gradient steps), clipped
surrogate, value loss, gradient-norm clipping at 0.5 and Adam. rollhub runs the shipped cartpole config's
``[trainer]`` (``rollhub demo cartpole``) on 16 fragments of 32 steps; SB3 runs the rl-zoo settings of the solve
benchmark with ``n_steps=64`` on 8 environments, so that its rollout buffer holds 512 samples, and ``train()`` is
timed after one ``learn()`` filled the buffer. rollhub is timed with each way of taking its gradients
(``[trainer] backend``): ``autograd`` (``backward()`` on the torch loss) and ``numpy`` (the same loss
differentiated by hand). All compute on one thread: torch's threads are set to 1, and the learner limits numpy's
BLAS to one thread, as in a run. Rounds interleave the columns; the table shows medians of milliseconds per
update and per gradient step, and of the process's CPU time per update (which a loaded machine inflates less).

Run: ``python benchmarks/ppo_update.py [--rounds 5] [--updates 20] [--backend both] [--no-sb3] [--json]``. The
SB3 column needs ``pip install -e '.[bench]'`` (stable-baselines3); without it rollhub's columns are timed alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from rollhub.experience import SampleFragment
from rollhub.run.assemble import ppo_learner
from rollhub.run.config import load_config
from rollhub.run.main import shipped_config
from rollhub.run.step_parts import EnvShape
from rollhub.train.ppo_loss import minibatch_bounds

SAMPLES, FRAGMENT = 512, 32


def cartpole_fragments(seed: int) -> list[SampleFragment]:
    """16 fragments of 32 CartPole-shaped steps (random values: the cost of an update does not depend on them)."""
    rng = np.random.default_rng(seed)

    def one() -> SampleFragment:
        n = FRAGMENT
        return SampleFragment(
            obs=rng.standard_normal((n, 4)).astype(np.float32), actions=rng.integers(0, 2, n),
            rewards=np.ones(n, np.float32), terminated=rng.random(n) < 0.02, truncated=np.zeros(n, bool),
            logp=np.full(n, np.log(0.5), np.float32), values=rng.standard_normal(n).astype(np.float32),
            final_values=np.zeros(n, np.float32), bootstrap_obs=np.zeros(4, np.float32), bootstrap_value=0.0,
            state_in=None, versions=np.zeros(n, np.int64), episode_ids=np.zeros(n, np.int64),
        )  # fmt: skip

    return [one() for _ in range(SAMPLES // FRAGMENT)]


def rollhub_update(backend: str) -> tuple[Callable[[], None], int]:
    """One update of the demo's learner with its gradients from ``backend``, and its gradient steps per update."""
    config = load_config(shipped_config("cartpole"), [f"trainer.backend={backend}"])
    learner = ppo_learner(config, EnvShape(obs_dim=4, n_actions=2), None)
    data = cartpole_fragments(0)
    cfg = learner.config
    steps = cfg.epochs * len(minibatch_bounds(SAMPLES, cfg.minibatches, cfg.minibatch_size))
    return lambda: learner.update(data), steps


def sb3_update() -> tuple[Callable[[], None], int]:
    """One ``PPO.train()`` of SB3 on a full 512-sample rollout buffer, and its gradient steps per update."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    env = make_vec_env("CartPole-v1", n_envs=8, seed=0)
    model = PPO(
        "MlpPolicy", env, n_steps=SAMPLES // 8, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
        ent_coef=0.0, learning_rate=1e-3, clip_range=0.2, seed=0, device="cpu", verbose=0,
    )  # fmt: skip
    model.learn(total_timesteps=SAMPLES)  # fills the rollout buffer (and trains once)
    return model.train, model.n_epochs * SAMPLES // model.batch_size


def per_update_s(update: Callable[[], None], n: int) -> tuple[float, float]:
    """Mean wall-clock and CPU seconds (this process's) per update over ``n`` updates, after one to warm up."""
    update()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        update()
    return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the table shows medians")
    p.add_argument("--updates", type=int, default=20, help="updates timed per tool and round")
    p.add_argument("--json", action="store_true", help="end with one line of JSON")
    p.add_argument(
        "--backend", choices=["autograd", "numpy", "both"], default="both",
        help="the learner's gradients: autograd, the hand-written numpy backward, or both (interleaved columns)",
    )  # fmt: skip
    p.add_argument("--no-sb3", action="store_true", help="time rollhub only (also when SB3 is not installed)")
    args = p.parse_args()
    torch.set_num_threads(1)
    backends = ["autograd", "numpy"] if args.backend == "both" else [args.backend]
    tools = {f"rollhub-{b}": rollhub_update(b) for b in backends}
    if not args.no_sb3:
        try:
            tools["sb3"] = sb3_update()
        except ImportError:
            print("stable-baselines3 is not installed (pip install -e '.[bench]'): timing rollhub only")
    rounds: dict[str, list[float]] = {name: [] for name in tools}
    cpu_rounds: dict[str, list[float]] = {name: [] for name in tools}
    for r in range(args.rounds):
        for name, (update, _) in tools.items():
            wall, cpu = per_update_s(update, args.updates)
            rounds[name].append(wall)
            cpu_rounds[name].append(cpu)
        print(f"round {r + 1}: " + ", ".join(f"{k} {1000 * v[-1]:.1f} ms" for k, v in rounds.items()), flush=True)
    med = {name: statistics.median(v) for name, v in rounds.items()}
    cpu_med = {name: statistics.median(v) for name, v in cpu_rounds.items()}
    print(f"{'tool':17} {'ms/update':>10} {'us/gradient step':>17} {'CPU ms/update':>14}")
    for name, (_, steps) in tools.items():
        print(f"{name:17} {1000 * med[name]:10.1f} {1e6 * med[name] / steps:17.0f} {1000 * cpu_med[name]:14.1f}")
    ratios = {}
    if len(backends) == 2:
        # on a loaded machine the median of the rounds' own ratios and the CPU time move less than the wall time
        ratios["autograd_over_numpy"] = med["rollhub-autograd"] / med["rollhub-numpy"]
        ratios["autograd_over_numpy_paired"] = statistics.median(
            a / b for a, b in zip(rounds["rollhub-autograd"], rounds["rollhub-numpy"], strict=True)
        )
        ratios["autograd_over_numpy_cpu"] = cpu_med["rollhub-autograd"] / cpu_med["rollhub-numpy"]
        print(
            f"autograd / numpy backward: {ratios['autograd_over_numpy']:.2f}x the time per update (median of the "
            f"rounds' ratios {ratios['autograd_over_numpy_paired']:.2f}x, CPU time "
            f"{ratios['autograd_over_numpy_cpu']:.2f}x)"
        )
    if "sb3" in med:
        for b in backends:
            ratios[f"{b}_over_sb3"] = med[f"rollhub-{b}"] / med["sb3"]
            print(f"rollhub {b} / SB3: {ratios[f'{b}_over_sb3']:.2f}x the time per update")
    if args.json:
        figures = {f"{k}_update_ms": round(1000 * v, 2) for k, v in med.items()}
        figures |= {f"{k}_update_cpu_ms": round(1000 * v, 2) for k, v in cpu_med.items()}
        print(json.dumps(figures | {k: round(v, 3) for k, v in ratios.items()} | {"rounds": args.rounds}))


if __name__ == "__main__":
    main()
