"""``rollhub demo arithmetic``: a tiny transformer learns two-digit addition by GRPO from scratch on a CPU.

By default the run is distributed (``rollhub serve``, a Ray fleet of group rollout workers, the GRPO trainer
pulling through ``TrainerClient``): see :mod:`rollhub.demos.arithmetic_fleet`. With ``--in-process`` it runs
the same learning setup (:mod:`rollhub.demos.arithmetic_task`: problems, held-out split, model, GRPO settings)
in one process, each part in the role it has in a distributed run:

- a :class:`~rollhub.rollout.group_manager.GroupRolloutManager` samples groups of training problems with a
  :class:`~rollhub.inference.torch_policy.LocalPolicy`;
- the loop plays the rollout worker: it syncs weights into the manager, asks it for the ``add`` lesson with
  the loaded ``policy_version`` and queues the :class:`~rollhub.experience.Group` objects it returns in a
  :class:`GroupQueue`;
- :class:`~rollhub.train.grpo.GRPOTrainer` pulls groups from that queue exactly as it would pull ``GET /batch``
  answers through ``TrainerClient``, and publishes weights to the policy and to a checkpoint directory.

Evaluation decodes greedily over every held-out problem (never trained on). Outputs: a learning-curve PNG,
the evaluation rollouts (JSONL), the last checkpoints, and, as the last line of stdout (and in
``--summary-json``), a JSON summary with ``eval_accuracy``, ``steps`` and ``wall_s``.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from rollhub.demos.arithmetic_task import (
    ArithmeticConfig,
    Record,
    build_policy,
    curriculum,
    evaluate,
    finish,
    model_shape,
    parse_args,
    plot,
)
from rollhub.demos.progress import Progress, say
from rollhub.demos.stopping import StopSignals
from rollhub.experience import Group
from rollhub.rollout.group_manager import GroupRolloutManager
from rollhub.rollout.group_writers import FileRolloutWriter
from rollhub.rollout.protocols import SampleRequest
from rollhub.train.grpo import GRPOTrainer
from rollhub.weights.checkpoint import CheckpointDirectory

WORKER_ID = "local-0"


class GroupQueue:
    """An in-process stand-in for the buffer server: producers ``put`` groups, the trainer takes batches.

    ``next_batch`` returns whole groups totalling at least ``batch_size`` sequences, oldest first, or None
    when fewer are queued, which is the contract of ``GET /batch``.
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self._groups: deque[Group] = deque()
        self._queued = 0

    def put(self, groups: list[Group]) -> None:
        """Queue groups, as ``POST /scored_data_list`` would."""
        self._groups.extend(groups)
        self._queued += sum(g.size for g in groups)

    def next_batch(self) -> list[Group] | None:
        """The oldest whole groups reaching ``batch_size`` sequences, or None (see the class docstring)."""
        if self._queued < self.batch_size:
            return None
        out, n = [], 0
        while n < self.batch_size:
            group = self._groups.popleft()
            out.append(group)
            n += group.size
        self._queued -= n
        return out


@dataclass(slots=True)
class Run:
    """The mutable state of a run, kept together so the loop reads top to bottom."""

    manager: GroupRolloutManager
    evaluator: GroupRolloutManager
    trainer: GRPOTrainer
    queue: GroupQueue
    checkpoints: CheckpointDirectory
    eval_writer: FileRolloutWriter
    rng: np.random.Generator
    eval_rng: np.random.Generator
    pending_weights: dict[str, torch.Tensor] | None = None
    record: Record = field(default_factory=Record)


def build(cfg: ArithmeticConfig) -> Run:
    """Construct the object graph: actor and evaluator policies, trainer, queue, checkpoints, writer."""
    curr, shape = curriculum(cfg), model_shape(cfg)
    learner = build_policy(shape, cfg.seed).model
    checkpoints = CheckpointDirectory(cfg.out_dir / "checkpoints", keep_last=2)
    run = Run(
        manager=GroupRolloutManager(curr, build_policy(shape, cfg.seed)),
        evaluator=GroupRolloutManager(curr, build_policy(shape, cfg.seed)),
        trainer=GRPOTrainer(learner, cfg.grpo()),
        queue=GroupQueue(batch_size=cfg.n_prompts * cfg.group_size),
        checkpoints=checkpoints,
        eval_writer=FileRolloutWriter(cfg.out_dir / "eval_rollouts.jsonl"),
        rng=np.random.default_rng(cfg.seed),
        eval_rng=np.random.default_rng(cfg.seed + 1),
    )

    def publish(step: int, state: dict[str, torch.Tensor]) -> None:
        run.pending_weights = state  # picked up by the producer's next weight sync
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            checkpoints.save(step, state, {"task": "arithmetic"})

    run.trainer.publish = publish
    run.manager.update_model({k: v.detach().clone() for k, v in learner.state_dict().items()})
    return run


def produce(run: Run, cfg: ArithmeticConfig) -> None:
    """The rollout worker's turn: sync weights, sample the lesson's training problems, queue the groups."""
    if run.pending_weights is not None:
        run.manager.update_model(run.pending_weights)
        run.pending_weights = None
    request = SampleRequest(run.trainer.policy_version, WORKER_ID, lesson_id="add", seed=int(run.rng.integers(2**31)))
    run.queue.put([g for g in run.manager.sample_batch(request).items if isinstance(g, Group)])


def evaluate_now(run: Run) -> float:
    """Greedy accuracy on every held-out problem; logs the rollouts and records the point."""
    step = run.trainer.step_count
    stats, groups = evaluate(run.evaluator, run.trainer.model, step, run.eval_rng)
    run.eval_writer.write(groups)
    run.record.add_eval(step, stats.accuracy)
    return stats.accuracy


def train(run: Run, cfg: ArithmeticConfig, stop: StopSignals, started: float) -> None:
    """Alternate producing and training until the target, ``max_steps``, ``max_wall_s`` or a stop signal."""
    bar = Progress("arithmetic") if cfg.progress else None
    trainer, record = run.trainer, run.record
    evaluate_now(run)
    while trainer.step_count < cfg.max_steps and time.monotonic() - started < cfg.max_wall_s:
        if stop.requested:
            break
        produce(run, cfg)
        groups = run.queue.next_batch()
        if groups is None:
            continue
        stats = trainer.step(groups)
        step = trainer.step_count
        record.reward.append((step, stats["mean_score"]))
        if step % cfg.eval_every == 0 and evaluate_now(run) >= cfg.target:
            break
        if bar is not None:
            elapsed = time.monotonic() - started
            bar.update(record.fraction(cfg, step, elapsed), **_fields(cfg, step, record, stats["mean_score"]))
    if record.eval[-1][0] != trainer.step_count:
        evaluate_now(run)
    record.stopped_by = stop.signal_name
    if bar is not None:
        state, reached = record.outcome(cfg)
        step = trainer.step_count
        fraction = record.fraction(cfg, step, time.monotonic() - started)
        reward = record.reward[-1][1] if record.reward else 0.0
        bar.close(state, reached, fraction, **_fields(cfg, step, record, reward))


def _fields(cfg: ArithmeticConfig, step: int, record: Record, reward: float) -> dict[str, object]:
    return {
        "held-out": f"{record.eval[-1][1]:.2f} (best {record.best:.2f})",
        "step": f"{step}/{cfg.max_steps}",
        "reward": f"{reward:.2f}",
    }


def main_in_process(cfg: ArithmeticConfig) -> int:
    """Run the in-process demo; print the JSON summary as the last line (see :func:`arithmetic_task.finish`)."""
    torch.set_num_threads(1)  # tiny matrices: more threads only add synchronisation on a busy CPU
    started = time.monotonic()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    with StopSignals() as stop:
        if cfg.progress:
            say(f"arithmetic (in-process): a+b, a and b in 0..{cfg.max_operand}; building policy and trainer...")
        run = build(cfg)
        try:
            train(run, cfg, stop, started)
        finally:
            run.eval_writer.close()
            run.manager.shutdown()
            run.evaluator.shutdown()
        steps = run.trainer.step_count
        if steps not in run.checkpoints.steps():
            run.checkpoints.save(steps, run.trainer.model.state_dict(), {"task": "arithmetic", "final": True})
        title = f"GRPO in one process: a+b, a,b<={cfg.max_operand}, {cfg.eval_problems()}"
        plot(run.record.eval, run.record.reward, title, cfg.out_dir / "learning_curve.png")
        summary = run.record.summary(cfg, steps, time.monotonic() - started)
        summary["variant"] = "in-process"
        return finish(cfg, summary, stop.exit_code)


def main(argv: list[str] | None = None) -> int:
    """``rollhub demo arithmetic [--in-process] ...``: the distributed run, or with ``--in-process`` this one."""
    cfg = parse_args(argv)
    if cfg.in_process:
        return main_in_process(cfg)
    from rollhub.demos import arithmetic_fleet

    return arithmetic_fleet.main_distributed(cfg)


if __name__ == "__main__":
    sys.exit(main())
