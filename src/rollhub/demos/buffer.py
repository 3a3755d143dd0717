"""``rollhub demo buffer``: the buffer server on its embedded default, rollout handlers and a trainer.

Starts ``rollhub serve`` (sqlite in a temporary directory), registers a trainer with :class:`TrainerClient`, runs
several :class:`RolloutHandler` threads that post scored groups (msgpack) and pause when the queue runs ahead of
the trainer, pulls leased batches and acknowledges them as a trainer would, and prints a JSON summary. Everything
crosses real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from rollhub.client import RolloutHandler, TrainerClient
from rollhub.demos.options import add_deprecated_alias, plain
from rollhub.run.child_server import start_server
from rollhub.run.progress import Progress, say
from rollhub.run.signals import StopSignals


class SimulatedHandler(RolloutHandler):
    """Groups of random completions of random lengths with random 0/1 scores (no model behind it)."""

    def __init__(self, server_url: str, *, seed: int, **settings: Any) -> None:
        super().__init__(server_url, **settings)
        self.rng = np.random.default_rng(seed)

    def collect(self) -> dict[str, Any]:
        lengths = self.rng.integers(32, 256, size=self.group_size)
        tokens = [self.rng.integers(0, 50_000, size=n, dtype=np.int32) for n in lengths]
        masks = [np.where(np.arange(n) < 16, -100, t).astype(np.int32) for n, t in zip(lengths, tokens, strict=True)]
        logprobs = [np.where(np.arange(n) < 16, 1.0, -self.rng.random(n)).astype(np.float32) for n in lengths]
        return {
            "tokens": tokens,
            "masks": masks,
            "scores": self.rng.choice([0.0, 1.0], size=self.group_size),
            "inference_logprobs": logprobs,
        }


def parser() -> argparse.ArgumentParser:
    """The demo's command line."""
    p = argparse.ArgumentParser(prog="rollhub demo buffer", description=plain(__doc__))
    p.add_argument("--max-seconds", type=float, default=10.0, help="how long the trainer pulls batches (10)")
    add_deprecated_alias(p, "--seconds", "--max-seconds", float)
    p.add_argument("--handlers", type=int, default=3, help="rollout handler threads posting groups (3)")
    p.add_argument("--batch-size", type=int, default=32, help="the trainer's batch size in sequences (32)")
    p.add_argument("--group-size", type=int, default=8, help="sequences per group each handler posts (8)")
    p.add_argument("--summary-json", type=Path, default=None, help="also write the summary JSON here")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress line on stderr (its percentage: the share of --max-seconds passed)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when it ran its time, ``128 + N`` when signal N stopped it."""
    args = parser().parse_args(argv)

    with StopSignals() as stop, tempfile.TemporaryDirectory(prefix="rollhub-demo-") as tmp:
        storage = f"sqlite:///{Path(tmp) / 'rollhub.db'}"
        if not args.no_progress:
            say(f"demo buffer: starting rollhub serve (sqlite in {tmp})...")
        server = start_server(storage)
        try:
            summary = _run(server.url, args, stop)
        finally:
            server.stop()
        summary["storage"] = "sqlite (embedded default)"
        summary["stopped_by"] = stop.signal_name
        print(json.dumps(summary), flush=True)
        if args.summary_json:
            args.summary_json.write_text(json.dumps(summary, indent=2))
        return stop.exit_code


def _fields(handlers: list[SimulatedHandler], batches: int, status: Any) -> dict[str, object]:
    # the handler counters first: an 80-column cut drops the fields at the end
    return {
        "paused now": f"{sum(h.state.name == 'PAUSED' for h in handlers)}/{len(handlers)}",
        "pauses total": sum(h.stats.pauses for h in handlers),
        "queue": status.queue_size,
        "groups in": sum(h.stats.groups_sent for h in handlers),
        "batches out": batches,
    }


def _run(url: str, args: argparse.Namespace, stop: StopSignals) -> dict[str, Any]:
    trainer = TrainerClient(url)
    trainer.register(
        batch_size=args.batch_size, max_token_len=256, num_steps=1_000_000, wandb_group="demo", wandb_project="rollhub"
    )
    trainer.get_batch()  # the first request starts the run: handlers may now register
    handlers = [
        SimulatedHandler(
            url, name="simulated", group_size=args.group_size, max_token_length=256, status_interval_s=0.2, seed=i
        )
        for i in range(args.handlers)
    ]
    threads = [threading.Thread(target=h.run, daemon=True) for h in handlers]
    for t in threads:
        t.start()
    start = time.monotonic()
    batches = sequences = 0
    progress = None if args.no_progress else Progress("buffer")
    status = trainer.status()
    while (elapsed := time.monotonic() - start) < args.max_seconds and not stop.requested:
        batch = trainer.get_batch(wait_s=1.0, lease_s=30.0)
        if batch is not None:
            batches += 1
            sequences += batch.sequences
            time.sleep(0.05)  # the "training step"
            trainer.ack(batch.batch_id)
        status = trainer.status()
        if progress is not None:
            progress.update(elapsed / args.max_seconds, **_fields(handlers, batches, status))
    if progress is not None:
        state = f"stopped by {stop.signal_name}" if stop.requested else "done"
        progress.close(state, not stop.requested, elapsed / args.max_seconds, **_fields(handlers, batches, status))
    for h in handlers:
        h.stop()
    for t in threads:
        t.join(15)
    status = trainer.status()
    trainer.close()
    return {
        "groups_in": sum(h.stats.groups_sent for h in handlers),
        "handler_pauses": sum(h.stats.pauses for h in handlers),
        "batches_out": batches,
        "sequences_out": sequences,
        "steps": status.current_step,
        "queue_left": status.queue_size,
        "wall_s": round(time.monotonic() - start, 2),
    }


if __name__ == "__main__":
    sys.exit(main())
