"""The group (LLM) path of ``rollhub run``: assemble a group run from its :class:`RunConfig` and run GRPO.

The run: the curriculum (``env`` and ``[[curriculum.lessons]]``), a source of groups (``writer``):

- ``in_process``: one :class:`~rollhub.rollout.group.manager.GroupRolloutManager` in this process filling a
  queue (:class:`~rollhub.run.sources.InProcessGroupSource`);
- ``server``: the buffer server (a child ``rollhub serve`` unless ``writer.url`` is given), a Ray
  :class:`~rollhub.rollout.backends.ray.RolloutFleet` of ``fleet.workers`` group rollout workers writing to it with
  :class:`~rollhub.rollout.writers.http_writer.HttpWriter`, and the trainer pulling leased batches through
  ``TrainerClient`` (:class:`~rollhub.run.sources.ServerGroupSource`);

or, for ``env.kind = "external"`` (:mod:`rollhub.run.external`), no producer of rollhub's at all: the
environment is another process posting groups to the server. Then the policy backend (``policy``; a
:class:`~rollhub.run.backend.PolicyBackend`): the built-in transformer copied into every process
(:class:`~rollhub.run.group_parts.LocalBackend`), or a Hugging Face model sampled through vLLM engines that every
update is pushed into (:class:`~rollhub.run.llm.EngineBackend`); the :class:`~rollhub.train.grpo.GRPOTrainer`
(``trainer``) in this process driven by :func:`~rollhub.train.grpo.train_grpo`, and a
:class:`~rollhub.run.group_monitor.GroupMonitor` (held-out evaluation, metrics, trackers, progress,
checkpoints). Everything that can be checked without starting anything (every lesson's environment builds) is
checked first.

The parts are built in :mod:`rollhub.run.group_parts`, :mod:`rollhub.run.group_server` and
:mod:`rollhub.run.external`, and put together by :func:`rollhub.run.assemble.assemble_group`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rollhub.run.assemble import assemble_group
from rollhub.run.config import RunConfig
from rollhub.run.group_monitor import train_and_report
from rollhub.run.group_parts import probe_group_env
from rollhub.run.rundir import Resumed, RunDirectory
from rollhub.run.signals import StopSignals


def run_group_path(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
                   note: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Assemble the run, train until a stop condition, write the summary and the PNG; return the summary."""
    curriculum = probe_group_env(config)
    torch.set_num_threads(1)  # tiny matrices: more threads only add synchronisation on a busy CPU
    started = time.perf_counter()
    with assemble_group(config, rundir, resumed, stop, note, curriculum, started) as parts:
        return train_and_report(parts.monitor, parts.source, parts.extra)
