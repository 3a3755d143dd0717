"""The step path of ``rollhub run``: assemble a step run from its :class:`RunConfig` and run PPO on it.

The run: a replay buffer (the ``writer``), a fleet of RolloutWorkers, each a StepRolloutManager over its
environments (``env``, ``policy``, ``fleet``): with ``fleet.backend = "ray"`` the buffer is a Ray actor and the
fleet a :class:`rollhub.rollout.backends.ray.RolloutFleet` of worker actors; with ``"local"`` both live in this process
(:class:`rollhub.rollout.backends.local.LocalFleet`, no Ray runtime); with ``"processes"`` the buffer does and each
worker is a process of its own (:class:`rollhub.rollout.backends.processes.ProcessFleet`, no Ray runtime). Then the
:class:`rollhub.train.ppo.PPOLearner` in this process (``trainer``), the weight publisher (``weights``) and a
:class:`rollhub.run.monitor.RunMonitor` (metrics, trackers, progress, checkpoints). Everything that can be
checked without starting anything (the environment builds and says its sizes) is checked first
(:func:`rollhub.run.step_parts.probe_env`). The parts are built in :mod:`rollhub.run.step_parts` and put
together by :func:`rollhub.run.assemble.assemble_step`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollhub.run.assemble import StepParts, assemble_step
from rollhub.run.config import RunConfig
from rollhub.run.rundir import Resumed, RunDirectory
from rollhub.run.signals import StopSignals
from rollhub.run.step_parts import EnvShape, probe_env


def run_step_path(
    config: RunConfig,
    rundir: RunDirectory,
    resumed: Resumed | None,
    stop: StopSignals,
    note: Callable[[str], None],
    shape: EnvShape | None = None,
) -> dict[str, Any]:
    """Assemble the run, train until a stop condition, write the summary and the PNG; return the summary.

    ``shape`` is the environment's sizes when the caller has probed it already (:func:`probe_env`).
    """
    shape = shape or probe_env(config)
    local = config.fleet.backend != "ray"
    note(f"{config.run.name}: loading {'torch' if local else 'Ray and torch'}...")
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    with assemble_step(config, rundir, resumed, stop, note, shape, started) as parts:
        return _train(config, rundir, parts, stop, started)


def _train(config: RunConfig, rundir: RunDirectory, parts: StepParts, stop: StopSignals,
           started: float) -> dict[str, Any]:  # fmt: skip
    from rollhub.run.report import summarize
    from rollhub.train.ppo import train_ppo

    monitor, state = parts.monitor, parts.state
    reason = "not started"
    try:
        reason = train_ppo(
            parts.learner,
            parts.source,
            parts.publisher,
            state,
            stop_reason=monitor.stop_reason,
            after_update=monitor.after_update,
        )
    finally:
        monitor.close(state, reason)
    wall_s = time.perf_counter() - started
    status = parts.fleet.status()
    return summarize(config, rundir, monitor, state, status, reason, stop.signal_name, wall_s, parts.buffer_status())
