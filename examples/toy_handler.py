"""A minimal rollout handler: a toy scored task (one-digit addition) sent to a rollhub server.

Each group is one prompt ``a + b =`` with ``group_size`` sampled answers, each scored +1 if correct and
-1 if not. The "policy" is a sloppy adder, off by one two times in three; a real environment would ask an
inference server instead. Everything else (registration, W&B names, pausing when the trainer
falls behind, retries, disconnecting on Ctrl-C) is done by ``RolloutHandler.run``.

    rollhub serve --storage memory          # in one terminal
    python examples/toy_trainer.py          # in another
    python examples/toy_handler.py          # and here
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any

import numpy as np

from rollhub.client import RolloutHandler

BOS, PLUS, EQUALS = 0, 1, 2
DIGIT = 10  # tokens 10..19 are the digits 0..9
ANSWER = 20  # tokens 20..38 are the sums 0..18
VOCAB_ANSWERS = 19


class ToyAdditionHandler(RolloutHandler):
    """One-digit addition: a prompt, ``group_size`` sampled answers, +1 / -1 scores."""

    def __init__(self, server_url: str, *, seed: int = 0, **settings: Any) -> None:
        super().__init__(server_url, **settings)
        self.rng = np.random.default_rng(seed)

    def collect(self) -> dict[str, Any]:
        a, b = (int(x) for x in self.rng.integers(0, 10, size=2))
        prompt = [BOS, DIGIT + a, PLUS, DIGIT + b, EQUALS]
        guesses = np.clip(a + b + self.rng.integers(-1, 2, size=self.group_size), 0, VOCAB_ANSWERS - 1)
        correct = guesses == a + b
        completion_logprob = -math.log(3)
        self.log_metrics({"accuracy": float(correct.mean())})
        return {
            "tokens": [[*prompt, ANSWER + int(g)] for g in guesses],
            "masks": [[-100] * len(prompt) + [ANSWER + int(g)] for g in guesses],
            "scores": np.where(correct, 1.0, -1.0),
            # 1.0 marks prompt positions, as the Atropos format does
            "inference_logprobs": [[1.0] * len(prompt) + [completion_logprob] for _ in guesses],
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Send toy addition groups to a rollhub server.")
    p.add_argument("--server-url", default="http://127.0.0.1:8000")
    p.add_argument("--name", default="toy_addition", help="env name; the server makes it unique for W&B")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups", type=int, default=None, help="stop after this many accepted groups")
    p.add_argument("--off-policy-tolerance", type=float, default=3)
    p.add_argument("--status-interval", type=float, default=1.0, help="seconds between /status-env reads")
    p.add_argument("--tracker", default="none", help="wandb, jsonl:PATH or none")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    handler = ToyAdditionHandler(
        args.server_url,
        name=args.name,
        group_size=args.group_size,
        max_token_length=8,
        off_policy_tolerance=args.off_policy_tolerance,
        status_interval_s=args.status_interval,
        tracker=args.tracker,
        seed=args.seed,
    )
    stats = handler.run(max_groups=args.groups)
    print(
        f"{handler.wandb_name}: sent {stats.groups_sent} groups ({stats.sequences_sent} sequences), "
        f"paused {stats.pauses} times, retried {stats.retries}, throttled {stats.throttled}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
