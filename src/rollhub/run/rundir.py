"""The run directory: effective config, metrics, episodes and checkpoints of one run.

Layout::

    RUN_DIR/config.toml                  the effective config (file, ROLLHUB_* variables and --set applied)
    RUN_DIR/metrics.jsonl                one JSON line per trainer update (version, trained_steps, losses, ...)
    RUN_DIR/episodes.jsonl               one JSON line per finished episode (index, env_steps, return, ...)
    RUN_DIR/checkpoints/step_N/model.safetensors   trainer weights, optimizer, RNG state, counters
    RUN_DIR/checkpoints/LATEST           the newest checkpointed version
    RUN_DIR/NAME_learning_curve.png      written when the run ends
    RUN_DIR/summary.json                 the last line the run printed

A checkpoint is written atomically (see :class:`rollhub.weights.checkpoint.CheckpointDirectory`). On resume the
JSONL files are cut back to what the checkpoint had seen (rows written after it, and a torn last line from a
killed process, are dropped), so the files continue without gaps or repeats.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rollhub.run.config import RunConfig, RunConfigError
from rollhub.run.toml import dumps
from rollhub.weights.checkpoint import Checkpoint, CheckpointDirectory

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
EPISODES = "episodes.jsonl"
CHECKPOINTS = "checkpoints"
SUMMARY = "summary.json"
EVAL_ROLLOUTS = "eval_rollouts.jsonl"


@dataclass(frozen=True)
class Resumed:
    """What a run continues from: the checkpoint's arrays and values (counters, RNG, optimizer settings)."""

    version: int
    arrays: dict[str, np.ndarray]
    values: dict[str, Any]


class RunDirectory:
    """One run's directory (created if missing).

    Args:
        root: the directory.
        keep_checkpoints: how many of the newest checkpoints are kept.
    """

    def __init__(self, root: Path, keep_checkpoints: int = 3) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.checkpoints = CheckpointDirectory(self.root / CHECKPOINTS, keep_last=keep_checkpoints)

    def holds_a_run(self) -> bool:
        """Whether a run has written here (a checkpoint or metrics)."""
        return self.checkpoints.latest_step() is not None or (self.root / METRICS).exists()

    def clear(self) -> None:
        """Remove what a previous run wrote here (only the files of the layout above)."""
        shutil.rmtree(self.root / CHECKPOINTS, ignore_errors=True)
        for name in (METRICS, EPISODES, SUMMARY, EVAL_ROLLOUTS):
            (self.root / name).unlink(missing_ok=True)
        self.checkpoints = CheckpointDirectory(self.root / CHECKPOINTS, keep_last=self.checkpoints.keep_last)

    def write_config(self, config: RunConfig) -> Path:
        """Write the effective config as ``config.toml`` (atomically)."""
        path = self.root / CONFIG
        _atomic_write(path, dumps(config.model_dump(mode="json")))
        return path

    def append(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Append ``rows`` as JSON lines to ``name`` and flush them to the OS."""
        if not rows:
            return
        with open(self.root / name, "a") as fh:
            fh.write("".join(json.dumps(row) + "\n" for row in rows))

    def read(self, name: str) -> list[dict[str, Any]]:
        """The complete JSON lines of ``name`` (a torn last line is skipped)."""
        path = self.root / name
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return rows

    def cut(self, name: str, keep: int) -> list[dict[str, Any]]:
        """Keep the first ``keep`` complete rows of ``name`` (atomically); return them."""
        rows = self.read(name)[:keep]
        _atomic_write(self.root / name, "".join(json.dumps(row) + "\n" for row in rows))
        return rows

    def save_checkpoint(self, version: int, arrays: Mapping[str, np.ndarray], values: dict[str, Any]) -> Path:
        """Save the checkpoint of ``version`` (arrays in safetensors, ``values`` as JSON metadata)."""
        return self.checkpoints.save(version, arrays, values)

    def latest_checkpoint(self) -> Resumed:
        """The newest checkpoint.

        Raises:
            RunConfigError: the directory holds none (nothing to resume).
        """
        if self.checkpoints.latest_step() is None:
            raise RunConfigError(
                f"{self.root} holds no checkpoint to resume from; start the run with 'rollhub run CONFIG.toml' "
                "and let it reach run.checkpoint_every updates"
            )
        ckpt: Checkpoint = self.checkpoints.load_latest()
        return Resumed(ckpt.step, ckpt.tensors, ckpt.metadata)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
