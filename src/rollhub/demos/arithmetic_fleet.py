"""``rollhub demo arithmetic``: GRPO through the buffer server, with a Ray fleet of group rollout workers.

The object graph, built here:

- ``rollhub serve`` (sqlite, ``--max-staleness K``) as a child process on a free loopback port;
- a local Ray runtime with a :class:`~rollhub.rollout.fleet.RolloutFleet` of
  :class:`~rollhub.rollout.worker.RolloutWorker` actors, each coordinating a
  :class:`~rollhub.rollout.group_manager.GroupRolloutManager` (its own policy copy), drawing lessons from
  the fleet's one shared curriculum actor, and writing its groups to the server with
  :class:`~rollhub.rollout.http_writer.HttpWriter` (msgpack, ``policy_version`` = the version it had loaded);
- the :class:`~rollhub.train.grpo.GRPOTrainer` in this process, pulling leased batches through
  ``TrainerClient`` (:class:`~rollhub.train.grpo_server.ServerGRPOLoop`, which also refuses groups more than
  ``K`` versions old), acknowledging them, and publishing every update's weights to the fleet through the Ray
  object store (and every ``--checkpoint-every`` updates to a checkpoint directory);
- an evaluator: one more ``GroupRolloutManager`` in this process, loaded with the trainer's weights, decoding
  greedily over the held-out problems (never trained on) every ``--eval-every`` steps.

What is learned and how (problems, held-out split, model, GRPO settings) is shared with ``--in-process``:
see :mod:`rollhub.demos.arithmetic_task`. SIGINT and SIGTERM stop the loop; the fleet, Ray and the server
are stopped in that order and the summary and PNG are still written.

Outputs in ``--out-dir``: the learning-curve PNG, the server's sqlite file, checkpoints, per-worker tracker
lines (JSONL); on stdout, as the last line, a JSON summary with ``eval_accuracy``, ``steps`` and ``wall_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollhub.curriculum import CurriculumConfig
from rollhub.demos.arithmetic_task import (
    MAX_LEN,
    ArithmeticConfig,
    Record,
    build_policy,
    curriculum,
    evaluate,
    finish,
    model_shape,
    plot,
)
from rollhub.demos.progress import Progress, say
from rollhub.demos.stopping import StopSignals
from rollhub.inference.torch_policy import TransformerConfig
from rollhub.rollout.group_manager import GroupRolloutManager


@dataclass(frozen=True)
class ArithmeticManagerFactory:
    """Picklable ``worker_id -> GroupRolloutManager``, run inside each Ray worker process."""

    curriculum: CurriculumConfig
    shape: TransformerConfig
    seed: int = 0

    def __call__(self, worker_id: str) -> GroupRolloutManager:
        torch.set_num_threads(1)  # small matrices; one thread per process keeps 2 cores from thrashing
        return GroupRolloutManager(self.curriculum, build_policy(self.shape, self.seed))


def start_fleet(cfg: ArithmeticConfig, server_url: str) -> Any:
    """A fleet of ``cfg.workers`` group rollout workers writing to the server (Ray must be up)."""
    from rollhub.rollout.fleet import FleetClient, FleetConfig
    from rollhub.rollout.http_writer import HttpWriter
    from rollhub.rollout.worker import RolloutWorkerConfig

    writer = HttpWriter(server_url, "arithmetic", cfg.group_size, MAX_LEN)
    worker_cfg = RolloutWorkerConfig(
        max_staleness=cfg.max_staleness,
        queue_size=2 * cfg.n_prompts,  # the queue holds groups: two training calls' worth
        tracker=f"jsonl:{cfg.out_dir.resolve()}/{{worker_id}}.jsonl",
        seed=cfg.seed,
    )
    managers = ArithmeticManagerFactory(curriculum(cfg), model_shape(cfg), cfg.seed)
    fleet_cfg = FleetConfig(n_workers=cfg.workers, worker_num_cpus=2 / (cfg.workers + 1), worker=worker_cfg)
    return FleetClient.start(fleet_cfg, managers, writer, curriculum=curriculum(cfg))


def build_trainer(cfg: ArithmeticConfig, fleet: Any) -> tuple[Any, Any]:
    """The GRPO trainer, publishing every step's weights to the fleet (and every ``checkpoint_every`` steps
    to the checkpoint directory), with version 0's weights already published; returns it and the directory."""
    from rollhub.train.grpo import GRPOTrainer
    from rollhub.weights.checkpoint import CheckpointDirectory

    checkpoints = CheckpointDirectory(cfg.out_dir / "checkpoints", keep_last=2)
    learner = build_policy(model_shape(cfg), cfg.seed).model

    def publish(step: int, state: dict[str, torch.Tensor]) -> None:
        fleet.publish(step, {k: v.numpy() for k, v in state.items()})
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            checkpoints.save(step, state, {"task": "arithmetic"})

    trainer = GRPOTrainer(learner, cfg.grpo(), publish)
    publish(0, {k: v.detach().clone() for k, v in learner.state_dict().items()})
    return trainer, checkpoints


def train(cfg: ArithmeticConfig, server_url: str, fleet: Any, stop: StopSignals, started: float) -> dict[str, Any]:
    """Register with the server, then pull, train, publish and evaluate until the target, a limit or a stop
    signal; returns the summary fields this run adds (the record is in ``["record"]``)."""
    from rollhub.client.trainer import TrainerClient
    from rollhub.train.grpo_server import ServerGRPOLoop

    client = TrainerClient(server_url)
    client.register(batch_size=cfg.n_prompts * cfg.group_size, max_token_len=MAX_LEN, num_steps=cfg.max_steps)
    trainer, checkpoints = build_trainer(cfg, fleet)
    learner = trainer.model
    loop = ServerGRPOLoop(trainer, client)
    evaluator = GroupRolloutManager(curriculum(cfg), build_policy(model_shape(cfg), cfg.seed))
    rng = np.random.default_rng(cfg.seed + 1)
    record = Record()
    record.add_eval(0, evaluate(evaluator, learner, 0, rng)[0].accuracy)
    bar = Progress("arithmetic") if cfg.progress else None
    staleness = 0.0
    while trainer.step_count < cfg.max_steps and time.monotonic() - started < cfg.max_wall_s and not stop.requested:
        stats = loop.step()
        if stats is None:
            fleet.check()  # no batch within wait_s: make sure the fleet can still produce
            continue
        if "skipped" in stats:
            continue
        step, staleness = trainer.step_count, stats["mean_staleness"]
        record.reward.append((step, stats["mean_score"]))
        if step % cfg.eval_every == 0:
            record.add_eval(step, evaluate(evaluator, learner, step, rng)[0].accuracy)
            if record.eval[-1][1] >= cfg.target:
                break
        if bar is not None:
            bar.update(record.fraction(cfg, step, time.monotonic() - started), **_fields(cfg, record, staleness))
    step = trainer.step_count
    if record.eval[-1][0] != step:
        record.add_eval(step, evaluate(evaluator, learner, step, rng)[0].accuracy)
    record.stopped_by = stop.signal_name
    if bar is not None:
        state, reached = record.outcome(cfg)
        fraction = record.fraction(cfg, step, time.monotonic() - started)
        bar.close(state, reached, fraction, **_fields(cfg, record, staleness))
    if step not in checkpoints.steps():
        checkpoints.save(step, learner.state_dict(), {"task": "arithmetic", "final": True})
    evaluator.shutdown()
    status = client.status().raw
    client.close()
    return {"record": record, "steps": step, **_counters(loop.counters, status)}


def _counters(counters: Any, status: dict[str, Any]) -> dict[str, Any]:
    return {
        "mean_group_staleness": round(float(np.mean(counters.staleness)), 3) if counters.staleness else 0.0,
        "max_group_staleness": max(counters.staleness, default=0),
        "trainer_stale_groups": counters.stale_groups,
        "server_stale_dropped": status.get("stale_dropped", status.get("stale")),
        "batches_skipped": counters.skipped,
    }


def _fields(cfg: ArithmeticConfig, record: Record, staleness: float) -> dict[str, object]:
    step, reward = record.reward[-1] if record.reward else (0, 0.0)
    return {
        "held-out": f"{record.eval[-1][1]:.2f} (best {record.best:.2f})",
        "step": f"{step}/{cfg.max_steps}",
        "reward": f"{reward:.2f}",
        "staleness": f"{staleness:.1f}",
    }


def run(cfg: ArithmeticConfig, stop: StopSignals | None = None) -> dict[str, Any]:
    """Start the server, Ray (unless already initialised), the fleet and the trainer; train until the target,
    ``max_steps``, ``max_wall_s`` or a stop signal; stop the fleet, Ray and the server in that order; draw
    the PNG and return the summary."""
    import ray

    from rollhub.demos.serve import start_server

    stop = stop or StopSignals()
    started = time.monotonic()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    db = cfg.out_dir / "rollhub.db"
    for stale_file in (db, db.with_name("rollhub.db-wal"), db.with_name("rollhub.db-shm")):
        stale_file.unlink(missing_ok=True)  # a fresh run must not resume a previous run's queue
    note = say if cfg.progress else (lambda _msg: None)
    note(f"arithmetic: starting rollhub serve (sqlite in {cfg.out_dir})...")
    server = start_server(f"sqlite:///{db}", "--max-staleness", str(cfg.max_staleness))
    fleet = None
    owns_ray = not ray.is_initialized()  # a caller's runtime (a cluster, a test session) is used and left up
    try:
        if owns_ray:
            note(f"arithmetic: server on {server.url}; starting Ray (2 CPUs)...")
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
            stop.install()  # again: the Ray runtime replaced the handlers with its own (a stack dump on SIGTERM)
        note(f"arithmetic: starting {cfg.workers} rollout worker(s) and the trainer...")
        fleet = start_fleet(cfg, server.url)
        result = train(cfg, server.url, fleet, stop, started)
        fleet_status = fleet.status()
    finally:
        if fleet is not None:
            fleet.stop()
        if owns_ray:
            ray.shutdown()
        server.stop()
    record: Record = result.pop("record")
    title = f"GRPO over rollhub serve, {cfg.workers} Ray rollout worker(s): a+b, a,b<={cfg.max_operand}"
    plot(record.eval, record.reward, title, cfg.out_dir / "learning_curve.png")
    summary = record.summary(cfg, result.pop("steps"), time.monotonic() - started)
    summary.update(variant="distributed", workers=cfg.workers, max_staleness=cfg.max_staleness, **result)
    summary["worker_restarts"] = fleet_status["restarts"]
    summary["groups_written"] = sum(w.get("items_sent", 0) for w in fleet_status["workers"])
    return summary


def main_distributed(cfg: ArithmeticConfig) -> int:
    """Run the distributed demo; print the JSON summary as the last line (see :func:`arithmetic_task.finish`)."""
    torch.set_num_threads(1)
    with StopSignals() as stop:
        summary = run(cfg, stop)
        return finish(cfg, summary, stop.exit_code)
