"""What a group run does around :func:`rollhub.train.grpo.train_grpo`: held-out evaluation, metrics, trackers,
progress, checkpoints, stopping, and at the end the learning-curve PNG and the summary.

Evaluation decodes greedily (``mode="eval"``) over ``eval.n_examples`` prompts of every lesson (default: every
prompt the environment keeps for evaluation) with a separate policy copy loaded with the trainer's weights,
at version 0, every ``eval.every`` versions and at the end; the rollouts go to ``eval_rollouts.jsonl``. It runs
in the trainer's thread between two updates, so it never straddles a weight push: every evaluated completion is
of exactly one version. A run without lessons to evaluate (``curriculum=None``: an external environment without
``env.eval_id``) evaluates nothing; its held-out accuracy is ``None`` throughout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rollhub.curriculum import CurriculumConfig
from rollhub.envs.group.scored import GroupStats
from rollhub.experience import Group
from rollhub.rollout.group.files import FileRolloutWriter
from rollhub.rollout.group.manager import GroupRolloutManager
from rollhub.rollout.protocols import SampleRequest
from rollhub.run.config import RunConfig
from rollhub.run.group_parts import ALL_EVAL_PROMPTS
from rollhub.run.monitor import make_trackers, write_metrics_row
from rollhub.run.probe import probe_prompts
from rollhub.run.progress import Progress, share
from rollhub.run.report import save_figure, staleness_axes
from rollhub.run.rundir import EVAL_ROLLOUTS, METRICS, SUMMARY, Resumed, RunDirectory
from rollhub.run.signals import StopSignals
from rollhub.train.grpo import GroupSource, GRPOState, GRPOTrainer, train_grpo


class GroupMonitor:
    """The hooks of one group-run session; restores its record and counters from ``resumed``.

    Args:
        config: the effective config.
        rundir: the run directory.
        trainer: the GRPO trainer whose state checkpoints hold.
        curriculum: the lessons (what is evaluated); ``None``: nothing is.
        shared: the run's curriculum object (its ``state_dict`` is checkpointed), or ``None``.
        stop: the stop flag of SIGINT, SIGTERM and SIGHUP.
        resumed: the checkpoint this session continues from, or ``None``.
        started: ``time.perf_counter()`` when the session started.
        backend: the policy backend (:class:`~rollhub.run.group.LocalBackend` or
            :class:`~rollhub.run.llm.EngineBackend`): the evaluator and its weights, the engine liveness check.
    """

    def __init__(self, config: RunConfig, rundir: RunDirectory, trainer: GRPOTrainer,
                 curriculum: CurriculumConfig | None, shared: Any, stop: StopSignals, resumed: Resumed | None,
                 started: float, backend: Any) -> None:  # fmt: skip
        self.config, self.rundir, self.trainer, self.shared, self.stop = config, rundir, trainer, shared, stop
        self.curriculum, self.started = curriculum, started
        values = resumed.values if resumed is not None else {}
        self.record: dict[str, Any] = values.get("record") or {"eval": [], "reward": [], "best": 0.0, "prompts": 0}
        self.state = GRPOState(**values["state"]) if "state" in values else GRPOState()
        self.metric_rows = len(rundir.cut(METRICS, values.get("metric_rows", 0))) if resumed else 0
        self.elapsed_before = float(values.get("elapsed_s", 0.0))
        self.sessions = int(values.get("sessions", 0)) + 1
        self.last_checkpoint = resumed.version if resumed else None
        self.backend = backend
        self.probe: list[list[int]] = []
        self.evaluator: GroupRolloutManager | None = backend.evaluator(curriculum) if curriculum else None
        self.eval_rng = np.random.default_rng([config.run.seed, 1, self.sessions])
        self.eval_writer = FileRolloutWriter(rundir.root / EVAL_ROLLOUTS)
        self.trackers = make_trackers(config, rundir)
        self.bar = Progress(config.run.name) if config.run.progress else None
        if not self.record["eval"] and self.evaluator is not None:
            self.evaluate()

    # ---- hooks of the loop ------------------------------------------------------------------------
    def stop_reason(self) -> str | None:
        """A stop signal or the time limit, else ``None``; raises when the inference engine died."""
        self.backend.check()
        if self.stop.requested:
            return f"stopped by {self.stop.signal_name}"
        if time.perf_counter() - self.started >= self.config.run.max_seconds:
            return "time limit"
        return None

    def after_update(self, state: GRPOState, stats: dict[str, float]) -> str | None:
        """Record the update, evaluate and checkpoint when due; return a reason to stop or ``None``."""
        run, version = self.config.run, self.trainer.policy_version
        self.record["reward"].append([version, round(stats["mean_score"], 5)])
        timings = {}
        if self.evaluator is not None and version % self.config.eval.every == 0:
            started = time.perf_counter()
            self.evaluate()
            timings["eval_s"] = time.perf_counter() - started
        figures = stats | timings | self.backend.metrics(self.trainer, self.probe)  # engine: the push, the probe
        accuracy = self.accuracy
        held_out = {} if accuracy is None else {"eval_accuracy": accuracy, "best_eval_accuracy": self.record["best"]}
        row = {
            "version": version,
            "trained_sequences": state.trained_sequences,
            **held_out,
            "elapsed_s": round(self.elapsed_s, 3),
            "stale_groups": state.stale_groups,
            **{k: float(f"{v:.6g}") for k, v in figures.items()},  # six significant digits
        }
        write_metrics_row(self.rundir, self.trackers, row)
        self.metric_rows += 1
        if self.bar is not None:
            self.bar.update(self.fraction(), **self.fields(stats["mean_score"]))
        if version % run.checkpoint_every == 0:
            self.checkpoint()
        if self.reached:
            return "target reached"
        if run.max_updates is not None and version >= run.max_updates:
            return "update limit"
        return None

    # ---- pieces -----------------------------------------------------------------------------------
    @property
    def accuracy(self) -> float | None:
        """The latest held-out accuracy (``None`` before any evaluation)."""
        return self.record["eval"][-1][1] if self.record["eval"] else None

    @property
    def reached(self) -> bool:
        """Whether the latest held-out accuracy reached ``eval.target_accuracy``."""
        target = self.config.eval.target_accuracy
        accuracy = self.accuracy
        return target is not None and accuracy is not None and accuracy >= target

    @property
    def elapsed_s(self) -> float:
        """Seconds of training over every session of the run."""
        return self.elapsed_before + time.perf_counter() - self.started

    def evaluate(self) -> float:
        """Greedy exact-answer accuracy of the trainer's weights on every lesson's evaluation prompts."""
        version = self.trainer.policy_version
        assert self.evaluator is not None and self.curriculum is not None  # only called with something to evaluate
        self.backend.load_eval_weights(self.evaluator, self.trainer.weights)
        groups: list[Group] = []
        for lesson in self.curriculum.lessons:
            n = self.config.eval.n_examples or ALL_EVAL_PROMPTS
            seed = int(self.eval_rng.integers(2**31))
            request = SampleRequest(version, "eval", lesson_id=lesson.lesson_id, mode="eval", n_examples=n, seed=seed)
            groups += [g for g in self.evaluator.sample_batch(request).items if isinstance(g, Group)]
        self.eval_writer.write(groups)
        self.probe = probe_prompts(groups)  # the engine probe's prompts (see rollhub.run.probe)
        accuracy = GroupStats.of(groups).accuracy
        self.record["eval"].append([version, round(accuracy, 6)])
        self.record["best"] = max(self.record["best"], accuracy)
        self.record["prompts"] = len(groups)
        return accuracy

    def checkpoint(self) -> None:
        """Save the trainer, the loop's counters, the record and the curriculum as the version's checkpoint."""
        version = self.trainer.policy_version
        if self.last_checkpoint == version:
            return
        arrays, trainer_values = self.trainer.state_dict()
        values = {
            "trainer": trainer_values,
            "state": dataclasses.asdict(self.state),
            "record": self.record,
            "metric_rows": self.metric_rows,
            "elapsed_s": self.elapsed_s,
            "sessions": self.sessions,
            "curriculum": self.shared.state_dict() if self.shared is not None else None,
        }
        self.rundir.save_checkpoint(version, arrays, values)
        self.last_checkpoint = version

    def fraction(self, with_time: bool = True) -> float:
        """Progress toward the nearest stopping condition (target, update limit and, ``with_time``, time limit)."""
        run, target = self.config.run, self.config.eval.target_accuracy
        shares = [share(time.perf_counter() - self.started, run.max_seconds) if with_time else 0.0]
        if target is not None:
            shares.append(share(self.record["best"], target))
        if run.max_updates is not None:
            shares.append(share(self.trainer.policy_version, run.max_updates))
        return max(shares)

    def fields(self, reward: float) -> dict[str, object]:
        """The fields of the progress line."""
        limit = self.config.run.max_updates
        accuracy = self.accuracy
        held_out = "-" if accuracy is None else f"{accuracy:.2f} (best {self.record['best']:.2f})"
        return {
            "held-out": held_out,
            "step": f"{self.trainer.policy_version}/{limit if limit is not None else '-'}",
            "reward": f"{reward:.2f}",
        }

    def close(self, reason: str) -> None:
        """Final evaluation, checkpoint and progress line; trackers finished, evaluator released."""
        if self.evaluator is not None and self.record["eval"][-1][0] != self.trainer.policy_version:
            self.evaluate()
        self.checkpoint()
        self.eval_writer.close()
        if self.evaluator is not None:
            self.evaluator.shutdown()
        if self.bar is not None:
            reward = self.record["reward"][-1][1] if self.record["reward"] else 0.0
            done = self.reached or reason == "update limit"
            self.bar.close(reason, done, self.fraction(with_time=False), **self.fields(reward))
        for tracker in self.trackers:
            tracker.finish()


def train_and_report(monitor: GroupMonitor, source: GroupSource, extra: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run :func:`train_grpo` with the monitor's hooks, close the monitor, write the PNG and the summary
    (with the fields ``extra()`` gives once training ended)."""
    reason = "not started"
    try:
        reason = train_grpo(
            monitor.trainer, source, monitor.state, stop_reason=monitor.stop_reason, after_update=monitor.after_update
        )
    finally:
        monitor.close(reason)
    return summarize(monitor, reason, extra())


def plot_curve(record: dict[str, Any], title: str, path: Path, metrics: list[dict[str, Any]]) -> None:
    """Held-out accuracy and mean training reward against trainer steps (every session of the run); below them,
    the staleness of the data each update trained on."""
    ax, _ = staleness_axes(metrics)
    if record["eval"]:
        ax.plot(*zip(*record["eval"], strict=True), marker="o", markersize=3, label="held-out accuracy (greedy)")
    if record["reward"]:
        ax.plot(*zip(*record["reward"], strict=True), alpha=0.5, label="mean training reward")
    ax.set_xlabel("trainer step (= policy version)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    save_figure(ax, path)


def correction_summary(trainer: GRPOTrainer, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The off-policy correction that ran and how much it did over the run: the preset, dual clipping, and the
    median effective-sample-size fraction and mean capped, masked and outside-support token fractions per update."""

    def over(key: str, how: Any) -> float | None:
        values = [r[key] for r in rows if isinstance(r.get(key), float)]
        return round(float(how(values)), 6) if values else None

    return {
        "preset": trainer.config.correction.name,
        "dual_clip": trainer.config.dual_clip,
        "ess_fraction_median": over("ess_fraction", np.median),
        "capped_fraction_mean": over("capped_fraction", np.mean),
        "masked_fraction_mean": over("masked_fraction", np.mean),
        "outside_support_fraction_mean": over("outside_support_fraction", np.mean),
        "version_lag_mean": over("version_lag_mean", np.mean),
    }


def summarize(monitor: GroupMonitor, reason: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Draw the learning curve, write ``summary.json`` and return the summary."""
    config, record, state = monitor.config, monitor.record, monitor.state
    png = monitor.rundir.root / f"{config.run.name}_learning_curve.png"
    rows = monitor.rundir.read(METRICS)
    variant = extra.get("variant", "")
    env_name = config.env.name if config.env.kind == "external" else config.env.id
    plot_curve(record, f"GRPO ({variant}) on {env_name}", png, rows)
    target = config.eval.target_accuracy
    rewards = [r for _, r in record["reward"]]
    gaps = {k: [r[k] for r in rows if isinstance(r.get(k), float)] for k in ("mismatch_abs", "probe_mismatch_abs")}
    evaluated = bool(record["eval"])
    summary = {
        "eval_accuracy": record["eval"][-1][1] if evaluated else None,
        "initial_eval_accuracy": record["eval"][0][1] if evaluated else None,
        "best_eval_accuracy": record["best"] if evaluated else None,
        "eval_problems": f"{record['prompts']} held-out prompts (mode 'eval')" if evaluated else "none evaluated",
        "steps": monitor.trainer.policy_version,
        "target_reached_at_step": next((s for s, a in record["eval"] if target is not None and a >= target), None),
        "wall_s": round(monitor.elapsed_s, 1),
        "target": target,
        "stop_reason": reason,
        "stopped_by": monitor.stop.signal_name,
        "curve": record["eval"],
        "train_reward_first10": round(float(np.mean(rewards[:10])), 4) if rewards else None,
        "train_reward_last10": round(float(np.mean(rewards[-10:])), 4) if rewards else None,
        "trained_sequences": state.trained_sequences,
        "tokens_per_s": round(sum(r.get("completion_tokens", 0.0) for r in rows) / max(monitor.elapsed_s, 1e-9), 1),
        "mismatch": {
            "batch_median_abs": float(np.median(gaps["mismatch_abs"])) if gaps["mismatch_abs"] else None,
            "batch_updates": len(gaps["mismatch_abs"]),
            "probe_median_abs": float(np.median(gaps["probe_mismatch_abs"])) if gaps["probe_mismatch_abs"] else None,
            "probe_updates": len(gaps["probe_mismatch_abs"]),
        },
        "correction": correction_summary(monitor.trainer, rows),
        "mean_group_staleness": round(float(np.mean(state.staleness)), 3) if state.staleness else 0.0,
        "max_group_staleness": state.max_staleness_seen,
        "trainer_stale_groups": state.stale_groups,
        "batches_skipped": state.skipped,
        "policy_version": monitor.trainer.policy_version,
        **extra,
        "curve_png": os.fspath(png),
        "out_dir": os.fspath(monitor.rundir.root),
        "run_dir": os.fspath(monitor.rundir.root),
    }
    (monitor.rundir.root / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
