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
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rollhub.client.trackers import Tracker
from rollhub.curriculum import CurriculumConfig
from rollhub.curriculum.shared import CurriculumLike
from rollhub.envs.group.scored import GroupStats
from rollhub.experience import Group
from rollhub.observe.run_figures import wait_summary
from rollhub.rollout.group.files import FileRolloutWriter
from rollhub.rollout.group.manager import GroupRolloutManager
from rollhub.rollout.protocols import SampleRequest
from rollhub.run.backend import PolicyBackend
from rollhub.run.config import RunSection
from rollhub.run.config_group import EvalSection
from rollhub.run.group_parts import ALL_EVAL_PROMPTS
from rollhub.run.monitor import MonitorBase
from rollhub.run.probe import probe_prompts
from rollhub.run.report import save_figure, staleness_axes
from rollhub.run.run_metrics import RunMetrics, run_versions
from rollhub.run.rundir import EVAL_ROLLOUTS, METRICS, Resumed, RunDirectory
from rollhub.run.signals import StopSignals
from rollhub.train.grpo import GroupSource, GRPOState, GRPOTrainer, train_grpo


class GroupMonitor(MonitorBase):
    """The hooks of one group-run session; restores its record and counters from ``resumed``.

    Args:
        run: the ``[run]`` section.
        evaluation: the ``[eval]`` section (how often, how many prompts, the target accuracy).
        rundir: the run directory.
        trainer: the GRPO trainer whose state checkpoints hold.
        curriculum: the lessons (what is evaluated); ``None``: nothing is.
        shared: the run's curriculum object (its ``state_dict`` is checkpointed), or ``None``.
        stop: the stop flag of SIGINT, SIGTERM and SIGHUP.
        resumed: the checkpoint this session continues from, or ``None``.
        started: ``time.perf_counter()`` when the session started.
        backend: the policy backend: the evaluator and its weights, the engine liveness check, its figures.
        trackers: the run's trackers.
        env_name: how the learning curve's title names the environment.
        run_metrics: the run's own figures (each update's wait, the versions trained on), continued from
            ``resumed``'s; default: new ones on ``backend``'s engines.
    """

    def __init__(self, run: RunSection, evaluation: EvalSection, rundir: RunDirectory, trainer: GRPOTrainer,
                 curriculum: CurriculumConfig | None, shared: CurriculumLike | None, stop: StopSignals,
                 resumed: Resumed | None, started: float, backend: PolicyBackend, trackers: list[Tracker],
                 env_name: str, run_metrics: RunMetrics | None = None) -> None:  # fmt: skip
        super().__init__(run, rundir, stop, trackers, resumed, started)
        self.eval, self.trainer, self.shared, self.curriculum = evaluation, trainer, shared, curriculum
        self.env_name = env_name
        values = self.values
        self.record: dict[str, Any] = values.get("record") or {"eval": [], "reward": [], "best": 0.0, "prompts": 0}
        self.state = GRPOState(**values["state"]) if "state" in values else GRPOState()
        self.sessions = int(values.get("sessions", 0)) + 1
        self.backend = backend
        self.run_metrics = run_metrics or RunMetrics(backend.engine_reads, run_versions(resumed))
        self.probe: list[list[int]] = []
        self.evaluator: GroupRolloutManager | None = backend.evaluator(curriculum) if curriculum else None
        self.eval_rng = np.random.default_rng([run.seed, 1, self.sessions])
        self.eval_writer = FileRolloutWriter(rundir.root / EVAL_ROLLOUTS)
        if not self.record["eval"] and self.evaluator is not None:
            self.evaluate()

    # ---- hooks of the loop ------------------------------------------------------------------------
    def stop_reason(self) -> str | None:
        """A stop signal or the time limit, else ``None``; raises when the inference engine died."""
        self.backend.check()
        return super().stop_reason()

    def after_update(self, state: GRPOState, stats: dict[str, float]) -> str | None:
        """Record the update, evaluate and checkpoint when due; return a reason to stop or ``None``."""
        version = self.trainer.policy_version
        self.record["reward"].append([version, round(stats["mean_score"], 5)])
        self.run_metrics.waited(stats.get("wait_s", 0.0), state.stale_groups)
        timings = {}
        if self.evaluator is not None and version % self.eval.every == 0:
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
        return self.log_update(row, version, self.fields(stats["mean_score"]))

    # ---- pieces -----------------------------------------------------------------------------------
    @property
    def accuracy(self) -> float | None:
        """The latest held-out accuracy (``None`` before any evaluation)."""
        return self.record["eval"][-1][1] if self.record["eval"] else None

    @property
    def reached(self) -> bool:
        """Whether the latest held-out accuracy reached ``eval.target_accuracy``."""
        target = self.eval.target_accuracy
        accuracy = self.accuracy
        return target is not None and accuracy is not None and accuracy >= target

    def best_and_target(self) -> tuple[float, float | None]:
        """The best held-out accuracy and ``eval.target_accuracy``."""
        return self.record["best"], self.eval.target_accuracy

    def evaluate(self) -> float:
        """Greedy exact-answer accuracy of the trainer's weights on every lesson's evaluation prompts."""
        version = self.trainer.policy_version
        assert self.evaluator is not None and self.curriculum is not None  # only called with something to evaluate
        self.backend.load_eval_weights(self.evaluator, self.trainer.weights)
        groups: list[Group] = []
        for lesson in self.curriculum.lessons:
            n = self.eval.n_examples or ALL_EVAL_PROMPTS
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

    def checkpoint_values(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The trainer, the loop's counters, the record and the curriculum."""
        arrays, trainer_values = self.trainer.state_dict()
        values = {
            "trainer": trainer_values,
            "state": dataclasses.asdict(self.state),
            "record": self.record,
            "token_versions": self.run_metrics.versions.to_json(),
            "metric_rows": self.metric_rows,
            "elapsed_s": self.elapsed_s,
            "sessions": self.sessions,
            "curriculum": self.shared.state_dict() if self.shared is not None else None,
        }
        return arrays, values

    def fields(self, reward: float) -> dict[str, object]:
        """The fields of the progress line."""
        limit = self.run.max_updates
        accuracy = self.accuracy
        held_out = "-" if accuracy is None else f"{accuracy:.2f} (best {self.record['best']:.2f})"
        return {
            "held-out": held_out,
            "step": f"{self.trainer.policy_version}/{limit if limit is not None else '-'}",
            "reward": f"{reward:.2f}",
        }

    def close(self, reason: str) -> None:
        """Final evaluation, checkpoint and progress line; trackers finished, evaluator released."""
        version = self.trainer.policy_version
        if self.evaluator is not None and self.record["eval"][-1][0] != version:
            self.evaluate()
        self.checkpoint(version)
        self.eval_writer.close()
        if self.evaluator is not None:
            self.evaluator.shutdown()
        reward = self.record["reward"][-1][1] if self.record["reward"] else 0.0
        self.finish(reason, version, self.fields(reward))


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
    record, state = monitor.record, monitor.state
    png = monitor.curve_png
    rows = monitor.rundir.read(METRICS)
    variant = extra.get("variant", "")
    plot_curve(record, f"GRPO ({variant}) on {monitor.env_name}", png, rows)
    target = monitor.eval.target_accuracy
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
        "token_versions": monitor.run_metrics.summary(),
        "trainer_wait_s": wait_summary([r["wait_s"] for r in rows if isinstance(r.get("wait_s"), int | float)]),
        "policy_version": monitor.trainer.policy_version,
        **extra,
        "curve_png": os.fspath(png),
        "out_dir": os.fspath(monitor.rundir.root),
        "run_dir": os.fspath(monitor.rundir.root),
    }
    return monitor.write_summary(summary)
