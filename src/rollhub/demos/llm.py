"""``rollhub demo llm``: GRPO on a Hugging Face model sampled through vLLM, weights pushed into the engine.

This is ``rollhub run`` on the config shipped as ``rollhub/run/configs/llm.toml``: a tiny random Qwen2 and a
byte-level BPE tokenizer are built into the run directory (``save_pretrained``; nothing is downloaded), a
vLLM engine is started on them from its own Python (``.venv-vllm``, made by ``make vllm``), then the buffer
server (sqlite), a Ray fleet sampling through the engine, and the GRPO trainer, which pushes its weights into
the engine after every update. Held-out accuracy (greedy, through vLLM) on two-digit addition rises from
chance to the target. Each option overrides one key of the config (``--set KEY=VALUE`` any other).

The last line of stdout is JSON: ``eval_accuracy``, ``steps``, ``wall_s``, ``weight_push_s`` (median, max),
``mismatch`` (median train-inference log-prob gap), ``tokens_per_s`` and the rest of the run's summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollhub.demos.options import Option, demo_parser, in_process, run_demo, write_config
from rollhub.demos.options import overrides as common_overrides

OPTIONS: dict[str, Option] = {  # option -> (config key it overrides, help, type)
    "model": ("policy.model", "a model directory or hub name instead of the tiny Qwen2 ('tiny')", str),
    "workers": ("fleet.workers", "rollout worker actors (1)", int),
    "in_process": (None, "no server and no Ray: sample in the trainer's process", bool),
    "max_seconds": ("run.max_seconds", "give up after this long (2400)", float),
    "max_steps": ("run.max_updates", "most trainer steps (3000)", int),
    "target": ("eval.target_accuracy", "stop at this held-out accuracy (0.9)", float),
    "seed": ("run.seed", "seed of the model, the sampling and the evaluation (0)", int),
    "out_dir": ("run.dir", "the run directory (rollhub-runs/llm)", Path),
}


def parser() -> argparse.ArgumentParser:
    """The demo's command line (defaults: the shipped config's values)."""
    return demo_parser("llm", __doc__, OPTIONS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The demo's options parsed from ``argv``."""
    return parser().parse_args(argv)


def overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` assignments the options stand for, then the explicit ``--set`` ones."""
    return common_overrides(args, OPTIONS)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when the target was reached, 1 when a limit came first or the engine failed, 2 for a bad
    option or config, ``128 + N`` when signal N stopped it."""
    from rollhub.inference.engine import EngineError
    from rollhub.run.config import load_config
    from rollhub.run.main import shipped_config

    p = parser()
    args = p.parse_args(argv)
    if args.write_config is not None:
        return write_config("llm", args.write_config, p, args)
    data = in_process(shipped_config("llm")) if args.in_process else shipped_config("llm")
    try:
        return run_demo("llm", lambda: load_config(data, overrides(args), source="the llm config"), args.summary_json)
    except EngineError as exc:
        print(f"rollhub demo llm: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
