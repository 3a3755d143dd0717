"""Peak memory of one GRPO update at Qwen2.5's vocabulary (151,936 tokens), with and without chunked log-probs.

A random Qwen2 with that vocabulary and a few small layers (hidden 64, 2 layers) is built in memory; each
measurement runs in a fresh process: build the model and a batch of ``--sequences`` sequences of ``--length``
tokens (the last ``--completion`` of them completion tokens), then one :meth:`GRPOTrainer.step` (forward, backward,
Adam) at temperature 0.7. The figure is the process's peak resident memory after the update minus its peak before
it (the model, the optimizer state that exists before the step, and the batch are in the baseline). "whole" computes
the ``[sequences, time, vocab]`` logits at once (``trainer.logprob_chunk = false``); "chunked" uses the default
block of 2^25 logits, recomputed in the backward pass.

    .venv/bin/python benchmarks/logprob_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import numpy as np


def measure(sequences: int, length: int, completion: int, chunked: bool) -> dict[str, float]:
    """One update in this process; the peak-memory figures in MiB."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollhub.experience import Group, Ragged
    from rollhub.train.grpo import DEFAULT_CHUNK_ELEMENTS, GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    rng = np.random.default_rng(0)
    prompt = length - completion
    groups = []
    size = min(8, sequences)  # sequences per group
    for _ in range(sequences // size):
        tokens = [rng.integers(0, 151_936, size=length).astype(np.int32) for _ in range(size)]
        masks = [np.concatenate([np.full(prompt, -100, np.int32), t[prompt:]]) for t in tokens]
        lps = [np.concatenate([np.ones(prompt), np.full(completion, -12.0)]).astype(np.float32) for _ in tokens]
        groups.append(Group(tokens=Ragged.from_rows(tokens, np.int32), masks=Ragged.from_rows(masks, np.int32),
                            scores=rng.random(size), inference_logprobs=Ragged.from_rows(lps, np.float32),
                            meta={"generation_params": {"temperature": 0.7}}, policy_version=0))  # fmt: skip
    trainer = GRPOTrainer(model, GRPOConfig(chunk_elements=DEFAULT_CHUNK_ELEMENTS if chunked else None))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trainer.step(groups)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"baseline_mib": round(before, 1), "peak_mib": round(after, 1), "update_mib": round(after - before, 1)}


def main(argv: list[str] | None = None) -> int:
    """Measure each configuration in its own process and print a table (and JSON with ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--completion", type=int, default=960)
    p.add_argument("--cases", default="whole:8,chunked:8,whole:16,chunked:16,chunked:64",
                   help="comma-separated MODE:SEQUENCES (whole at 64 x 1,024 needs about 40 GB)")  # fmt: skip
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        mode, n = args.one.split(":")
        print(json.dumps(measure(int(n), args.length, args.completion, mode == "chunked")))
        return 0
    rows = []
    for case in args.cases.split(","):
        cmd = [sys.executable, __file__, "--one", case, "--length", str(args.length),
               "--completion", str(args.completion)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        mode, n = case.split(":")
        rows.append({"mode": mode, "sequences": int(n), "length": args.length, **json.loads(out)})
        print(f"{mode:8s} {n:>3s} x {args.length}: update {rows[-1]['update_mib']:>9,.0f} MiB "
              f"(peak {rows[-1]['peak_mib']:,.0f} MiB)", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
