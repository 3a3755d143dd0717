"""One PPO update of the CartPole demo: rollhub's ``PPOLearner.update`` next to Stable-Baselines3's ``PPO.train``.

Both train the same network (separate 64x64 tanh MLPs for the policy and the value, 4 observations, 2 actions)
with the same work per update: 512 samples, 20 epochs of 256-sample minibatches (40 gradient steps), clipped
surrogate, value loss, gradient-norm clipping at 0.5 and Adam. rollhub runs the shipped cartpole config's
``[trainer]`` (``rollhub demo cartpole``) on 16 fragments of 32 steps; SB3 runs the rl-zoo settings of the solve
benchmark with ``n_steps=64`` on 8 environments, so that its rollout buffer holds 512 samples, and ``train()`` is
timed after one ``learn()`` filled the buffer. Both compute on one thread: torch's threads are set to 1, and the
learner limits numpy's BLAS (its gradients) to one thread, as in a run. Rounds interleave the two; the table
shows medians of milliseconds per update and per gradient step.

Run: ``python benchmarks/ppo_update.py [--rounds 5] [--updates 20] [--json]``. The SB3 side needs
``pip install -e '.[bench]'`` (stable-baselines3).
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


def rollhub_update() -> tuple[Callable[[], None], int]:
    """One update of the demo's learner, and its gradient steps per update."""
    config = load_config(shipped_config("cartpole"))
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


def per_update_s(update: Callable[[], None], n: int) -> float:
    """Mean seconds per update over ``n`` updates, after one to warm up."""
    update()
    start = time.perf_counter()
    for _ in range(n):
        update()
    return (time.perf_counter() - start) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the table shows medians")
    p.add_argument("--updates", type=int, default=20, help="updates timed per tool and round")
    p.add_argument("--json", action="store_true", help="end with one line of JSON")
    args = p.parse_args()
    torch.set_num_threads(1)
    tools = {"rollhub": rollhub_update(), "sb3": sb3_update()}
    rounds: dict[str, list[float]] = {name: [] for name in tools}
    for r in range(args.rounds):
        for name, (update, _) in tools.items():
            rounds[name].append(per_update_s(update, args.updates))
        print(f"round {r + 1}: " + ", ".join(f"{k} {1000 * v[-1]:.1f} ms" for k, v in rounds.items()), flush=True)
    med = {name: statistics.median(v) for name, v in rounds.items()}
    print(f"{'tool':10} {'ms/update':>10} {'us/gradient step':>17}")
    for name, (_, steps) in tools.items():
        print(f"{name:10} {1000 * med[name]:10.1f} {1e6 * med[name] / steps:17.0f}")
    print(f"rollhub / SB3: {med['rollhub'] / med['sb3']:.2f}x the time per update")
    if args.json:
        figures = {f"{k}_update_ms": round(1000 * v, 2) for k, v in med.items()}
        print(json.dumps(figures | {"ratio_update": round(med["rollhub"] / med["sb3"], 3), "rounds": args.rounds}))


if __name__ == "__main__":
    main()
