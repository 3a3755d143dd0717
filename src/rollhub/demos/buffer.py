"""``rollhub demo buffer``: the buffer server on its embedded default, simulated rollout handlers and a trainer.

Starts ``rollhub serve`` (sqlite in a temporary directory), registers a trainer, runs several rollout handlers
that post scored groups and pause when the queue runs ahead of the trainer (the Atropos rule), pulls batches as
the trainer would, and prints a summary. Everything crosses real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from rollhub.demos.progress import Progress
from rollhub.demos.serve import start_server


def _handler(url: str, name: str, group_size: int, stop: threading.Event, stats: dict[str, Any], seed: int) -> None:
    rng = random.Random(seed)
    env = {"max_token_length": 256, "desired_name": name, "weight": 1.0, "group_size": group_size}
    with httpx.Client(base_url=url, timeout=10) as c:
        while not stop.is_set():
            answer = c.post("/register-env", json=env).json()
            if answer["status"] == "success":
                break
            time.sleep(0.1)
        else:
            return
        env_id = answer["env_id"]
        batch_size = c.get("/info").json()["batch_size"]
        paused, next_check = False, 0.0
        while not stop.is_set():
            if time.monotonic() >= next_check:
                status = c.get("/status-env", params={"env_id": env_id}).json()
                paused = status["queue_size"] * group_size >= 3 * batch_size
                stats["pauses"] += int(paused)
                next_check = time.monotonic() + 0.2
            if paused:
                time.sleep(0.05)
                continue
            lengths = [rng.randint(32, 256) for _ in range(group_size)]
            tokens = [[rng.randrange(50_000) for _ in range(n)] for n in lengths]
            group = {
                "tokens": tokens,
                "masks": [[-100] * 16 + t[16:] for t in tokens],
                "scores": [rng.choice([0.0, 1.0]) for _ in range(group_size)],
                "inference_logprobs": [[1.0] * 16 + [-rng.random() for _ in t[16:]] for t in tokens],
                "env_id": env_id,
            }
            if c.post("/scored_data", json=group).status_code == 200:
                stats["groups_in"] += 1
        c.post("/disconnect-env", json={"env_id": env_id})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollhub demo buffer", description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the trainer pulls batches")
    parser.add_argument("--handlers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--summary-json", type=Path, default=None)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="rollhub-demo-") as tmp:
        storage = f"sqlite:///{Path(tmp) / 'rollhub.db'}"
        server = start_server(storage)
        try:
            summary = _run(server.url, args, storage)
        finally:
            server.stop()
    print(json.dumps(summary))
    if args.summary_json:
        args.summary_json.write_text(json.dumps(summary, indent=2))
    return 0


def _run(url: str, args: argparse.Namespace, storage: str) -> dict[str, Any]:
    stats: dict[str, Any] = {"groups_in": 0, "pauses": 0}
    stop = threading.Event()
    registration = {
        "wandb_group": "demo",
        "wandb_project": "rollhub",
        "batch_size": args.batch_size,
        "max_token_len": 256,
        "checkpoint_dir": "",
        "save_checkpoint_interval": 0,
        "starting_step": 0,
        "num_steps": 1_000_000,
    }
    start = time.monotonic()
    batches = sequences = 0
    with httpx.Client(base_url=url, timeout=30) as trainer:
        trainer.post("/register", json=registration)
        trainer.get("/batch")  # the first request starts the run: handlers may now register
        handlers = [
            threading.Thread(target=_handler, args=(url, "toy", args.group_size, stop, stats, i), daemon=True)
            for i in range(args.handlers)
        ]
        for h in handlers:
            h.start()
        progress = Progress(args.seconds, "demo buffer")
        while (elapsed := time.monotonic() - start) < args.seconds:
            batch = trainer.get("/batch", params={"wait_s": 1.0}).json()["batch"]
            if batch:
                batches += 1
                sequences += sum(len(item["tokens"]) for item in batch)
                time.sleep(0.05)  # the "training step"
            status = trainer.get("/status").json()
            progress.update(
                elapsed,
                groups_in=stats["groups_in"],
                batches=batches,
                step=status["current_step"],
                queue=status["queue_size"],
            )
        progress.close()
        stop.set()
        for h in handlers:
            h.join(10)
        status = trainer.get("/status").json()
    wall = time.monotonic() - start
    return {
        "storage": storage,
        "groups_in": stats["groups_in"],
        "batches_out": batches,
        "sequences_out": sequences,
        "steps": status["current_step"],
        "queue_left": status["queue_size"],
        "handler_pause_checks": stats["pauses"],
        "wall_s": round(wall, 2),
    }


if __name__ == "__main__":
    sys.exit(main())
