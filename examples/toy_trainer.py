"""A minimal trainer loop: register, pull leased batches, "train", acknowledge.

The update is a stand-in (it only reports the batch's mean score and accuracy); a real trainer computes
its loss on each group's ``tokens``, ``masks`` and ``scores`` here and publishes new weights to its inference servers.

    rollhub serve --storage memory          # in one terminal
    python examples/toy_trainer.py          # in another
    python examples/toy_handler.py          # and a third
"""

from __future__ import annotations

import argparse

import numpy as np

from rollhub.client import TrainerClient


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Pull batches from a rollhub server and train on them (toy).")
    p.add_argument("--server-url", default="http://127.0.0.1:8000")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--wandb-project", default="rollhub-toy")
    p.add_argument("--wandb-group", default="toy")
    args = p.parse_args(argv)

    with TrainerClient(args.server_url) as trainer:
        trainer.register(
            batch_size=args.batch_size,
            max_token_len=8,
            num_steps=args.steps,
            wandb_project=args.wandb_project,
            wandb_group=args.wandb_group,
        )
        print(f"registered with {args.server_url}; waiting for rollout handlers", flush=True)
        step = 0
        while step < args.steps:
            batch = trainer.get_batch(wait_s=5.0, lease_s=60.0)
            if batch is None:
                print("no batch yet", flush=True)
                continue
            scores = np.concatenate([group.scores for group in batch])  # each group: a rollhub.experience.Group
            # training on the batch goes here
            if batch.batch_id is not None:
                trainer.ack(batch.batch_id)
            step += 1
            print(
                f"step {step}: {len(batch)} groups, {batch.sequences} sequences, "
                f"mean score {scores.mean():+.3f}, accuracy {(scores > 0).mean():.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
