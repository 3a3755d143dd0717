"""The group (LLM) path of ``rollhub run``: build the object graph from a :class:`RunConfig` and run GRPO.

The graph: the run's curriculum (``env`` and ``[[curriculum.lessons]]``), a source of groups (``writer``):

- ``in_process``: one :class:`~rollhub.rollout.group.manager.GroupRolloutManager` in this process filling a
  queue (:class:`~rollhub.run.sources.InProcessGroupSource`);
- ``server``: the buffer server (a child ``rollhub serve`` unless ``writer.url`` is given), a Ray
  :class:`~rollhub.rollout.backends.ray.RolloutFleet` of ``fleet.workers`` group rollout workers writing to it with
  :class:`~rollhub.rollout.writers.http_writer.HttpWriter`, and the trainer pulling leased batches through
  ``TrainerClient`` (:class:`~rollhub.run.sources.ServerGroupSource`);

or, for ``env.kind = "external"`` (:mod:`rollhub.run.external`), no producer of rollhub's at all: the
environment is another process posting groups to the server. Then the policy (``policy``): the built-in
transformer copied into every process (:class:`~rollhub.run.group_parts.LocalBackend`), or a Hugging Face model
sampled through vLLM engines that every update is pushed into (:class:`~rollhub.run.llm.EngineBackend`); the
:class:`~rollhub.train.grpo.GRPOTrainer` (``trainer``) in this process driven by
:func:`~rollhub.train.grpo.train_grpo`, and a :class:`~rollhub.run.group_monitor.GroupMonitor` (held-out
evaluation, metrics, trackers, progress, checkpoints). Everything that can be checked without starting
anything (every lesson's environment builds) is checked first.

The parts are built in :mod:`rollhub.run.group_parts`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rollhub.curriculum import CurriculumConfig
from rollhub.inference.openai_client import InferenceError
from rollhub.run.config import RunConfig
from rollhub.run.group_parts import (
    LocalBackend,
    make_backend,
    make_trainer,
    probe_group_env,
    publisher,
    sessions_before,
)
from rollhub.run.rundir import Resumed, RunDirectory
from rollhub.run.signals import StopSignals


def run_group_path(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
                   note: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Build the graph, train until a stop condition, write the summary and the PNG; return the summary."""
    curriculum = probe_group_env(config)
    torch.set_num_threads(1)  # tiny matrices: more threads only add synchronisation on a busy CPU
    started = time.perf_counter()
    if config.env.kind == "external":
        from rollhub.run.external import ENDPOINTS

        (rundir.root / ENDPOINTS).unlink(missing_ok=True)  # a watcher must never read a previous session's
    backend = make_backend(config, rundir, note, lambda: stop.requested)
    try:
        if config.env.kind == "external":
            from rollhub.run.external import run_external

            return run_external(config, rundir, resumed, stop, note, curriculum, started, backend)
        assert curriculum is not None  # a group environment always has its lessons
        if config.writer.kind == "in_process":
            return _in_process(config, rundir, resumed, stop, note, curriculum, started, backend)
        from rollhub.run.group_server import run_server_variant

        return run_server_variant(config, rundir, resumed, stop, note, curriculum, started, backend)
    except InferenceError:
        backend.check()  # when the engine died, say that (its pid, exit code and log) rather than "no answer"
        raise
    finally:
        backend.close()


def _in_process(config: RunConfig, rundir: RunDirectory, resumed: Resumed | None, stop: StopSignals,
                note: Callable[[str], None], curriculum: CurriculumConfig, started: float,
                backend: Any) -> dict[str, Any]:  # fmt: skip
    from rollhub.curriculum import SharedCurriculum
    from rollhub.run.group_monitor import GroupMonitor, train_and_report
    from rollhub.run.sources import InProcessGroupSource

    note(f"{config.run.name} (in-process): building the policy, the trainer and the evaluator...")
    shared = SharedCurriculum(curriculum)
    if resumed is not None and resumed.values.get("curriculum"):
        shared.load_state_dict(resumed.values["curriculum"])
    manager = backend.manager_factory(curriculum)("local-0")
    batch = config.trainer.groups_per_batch * config.env.group_size
    seed = config.run.seed + sessions_before(resumed)
    source = InProcessGroupSource(manager, shared, batch, seed=seed, max_staleness=config.writer.max_staleness)
    trainer = make_trainer(config, resumed, backend.trainer_model())
    local = isinstance(backend, LocalBackend)
    trainer.publish = publisher(config, rundir, backend, source.offer_weights if local else source.offer_version)
    monitor = GroupMonitor(config, rundir, trainer, curriculum, shared, stop, resumed, started, backend)
    try:
        return train_and_report(monitor, source, lambda: {"variant": "in-process", **backend.summary()})
    finally:
        manager.shutdown()
