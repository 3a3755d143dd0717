"""Buffer core benchmark: the cost of one poll and one ingest as the queue grows (in process, memory storage).

Run: ``.venv/bin/python benchmarks/buffer_poll.py``. For each queue length it fills the core with groups of
``--group-size`` sequences (one token each: the payload does not matter here), then times

* ``ingest``: one more group ingested (the queue bound and the undo bookkeeping of every write);
* ``serve``: one batch of ``--batch-size`` sequences formed, served and re-queued by an ingest (the common poll);
* ``idle poll``: a poll that forms nothing although enough sequences are queued (every group one sequence short
  of a pack), with ``max_staleness`` set: a trainer long-polling a queue that cannot make a batch yet.

Printed: microseconds per operation (median of ``--repeats`` rounds). A poll whose cost does not grow with the
queue prints about the same figure on every row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from rollhub.buffer import BufferConfig, ExperienceBuffer, make_storage
from rollhub.experience import Group, Ragged


def make_group(size: int, version: int) -> Group:
    rows = [np.array([i], dtype=np.int32) for i in range(size)]
    return Group(
        tokens=Ragged.from_rows(rows, np.int32),
        masks=Ragged.from_rows(rows, np.int32),
        scores=np.zeros(size),
        policy_version=version,
    )


def registered(batch_size: int, max_staleness: int | None) -> ExperienceBuffer:
    buffer = ExperienceBuffer(make_storage("memory"), BufferConfig(max_staleness=max_staleness))
    try:
        from rollhub.buffer import TrainerRun

        buffer.register_trainer(TrainerRun(batch_size=batch_size))
    except ImportError:  # releases whose core takes the wire registration
        from rollhub.wire.models import Registration

        fields = dict(wandb_group="b", wandb_project="b", max_token_len=0, checkpoint_dir="")
        buffer.register_trainer(
            Registration(batch_size=batch_size, save_checkpoint_interval=0, starting_step=0, num_steps=10**9, **fields)
        )
    return buffer


def per_op_us(op, count: int, repeats: int) -> float:
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            op()
        rounds.append((time.perf_counter() - start) / count * 1e6)
    return statistics.median(rounds)


def measure(length: int, args: argparse.Namespace) -> tuple[float, float, float]:
    group = make_group(args.group_size, 0)
    buffer = registered(args.batch_size, max_staleness=None)
    for _ in range(length):
        buffer.ingest([group])
    ingest = per_op_us(lambda: buffer.ingest([group]), args.ops, args.repeats)

    def serve() -> None:
        assert buffer.next_batch() is not None
        buffer.ingest([group] * (args.batch_size // args.group_size))

    served = per_op_us(serve, args.ops, args.repeats)
    # groups one sequence short never complete a pack of the largest size (one full group at the back), so every
    # sequence is queued and yet no batch of two packs forms
    idle = registered(2 * args.group_size, max_staleness=10**6)
    small = make_group(args.group_size - 1, 0)
    for _ in range(length):
        idle.ingest([small])
    idle.ingest([make_group(args.group_size, 0)])
    polled = per_op_us(lambda: idle.next_batch(), args.ops, args.repeats)
    assert idle.next_batch() is None
    return ingest, served, polled


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1_000, 10_000, 50_000])
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print("| queued groups | ingest us | serve us | idle poll us |")
    print("|---:|---:|---:|---:|")
    for length in args.lengths:
        ingest, served, polled = measure(length, args)
        print(f"| {length} | {ingest:.1f} | {served:.1f} | {polled:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
