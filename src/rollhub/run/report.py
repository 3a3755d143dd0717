"""The end of a run: the learning-curve PNG and the summary (printed as the last line, kept as summary.json)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rollhub.run.config import RunConfig
from rollhub.run.rundir import EPISODES, METRICS, RunDirectory

if TYPE_CHECKING:
    from rollhub.run.monitor import RunMonitor
    from rollhub.train.ppo import PPOState


def staleness_axes(metrics: list[dict[str, Any]]) -> tuple[Any, Any]:
    """A figure of two panels: the learning curve on top, and below it the staleness of the data each update
    trained on (``staleness``: the largest ``trainer_version - policy_version`` in the batch, per version), from
    the run directory's metrics rows. Returns the two axes; the caller draws the top one and saves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), height_ratios=(3, 1))
    rows = [r for r in metrics if "staleness" in r]
    if rows:
        bottom.step([r["version"] for r in rows], [r["staleness"] for r in rows], where="post", linewidth=1)
        bottom.set_ylim(-0.2, max(1.0, max(r["staleness"] for r in rows)) + 0.5)
    bottom.set_xlabel("trainer update (= policy version)")
    bottom.set_ylabel("staleness")
    bottom.grid(alpha=0.3)
    return top, bottom


def save_figure(ax: Any, path: Path) -> None:
    """Lay out and write the figure of ``ax`` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = ax.figure
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


#: How each ``fleet.backend`` runs its rollout workers, as progress lines name it.
WORKERS_AS = {"ray": "Ray actors", "local": "threads", "processes": "processes"}
#: The fleet of each ``fleet.backend``, as the learning curve's title names it.
FLEET_TITLES = {
    "ray": "Ray rollout fleet",
    "local": "local rollout fleet (threads, no Ray)",
    "processes": "rollout fleet of processes (no Ray)",
}


def curve_title(config: RunConfig) -> str:
    """The learning curve's title: the trainer, the environment and the fleet that ran (``fleet.backend``)."""
    return f"{config.trainer.kind.upper()} on {config.env.id}, {FLEET_TITLES[config.fleet.backend]}"


def plot_curve(episodes: list[dict[str, Any]], config: RunConfig, path: Path, metrics: list[dict[str, Any]]) -> None:
    """Episode return against environment steps (every session of the run), with the running mean; below it, the
    staleness of the data each update trained on."""

    window = config.run.window
    returns = np.array([e["return"] for e in episodes], dtype=float)
    steps = np.array([e["env_steps"] for e in episodes], dtype=float)
    mean = np.array([returns[max(0, i - window + 1) : i + 1].mean() for i in range(len(returns))])
    ax, _ = staleness_axes(metrics)
    ax.plot(steps, returns, ".", alpha=0.3, label="episode return")
    ax.plot(steps, mean, "-", label=f"mean of last {window}")
    if config.run.target_return is not None:
        target = config.run.target_return
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"{target:g}")
    ax.set_xlabel("environment steps (finished episodes)")
    ax.set_ylabel("return")
    ax.set_title(curve_title(config))
    ax.legend(loc="lower right")
    save_figure(ax, path)


def summarize(config: RunConfig, rundir: RunDirectory, monitor: RunMonitor, state: PPOState,
              fleet_status: dict[str, Any], reason: str, stopped_by: str | None, wall_s: float,
              buffer_status: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Draw the learning curve, write ``summary.json`` and return the summary.

    ``buffer_stale_dropped`` counts the fragments the replay buffer dropped as too stale before serving (it
    compares against the version the trainer published; the trainer trains on every fragment served)."""
    from rollhub.rollout.stats import STAGES

    episodes = rundir.read(EPISODES)  # the whole run's, earlier sessions' too (the monitor keeps none)
    png = monitor.curve_png
    plot_curve(episodes, config, png, rundir.read(METRICS))
    pipeline = fleet_status.get("pipeline", {})
    summary = {
        "mean_return_last20": round(float(np.mean([e["return"] for e in episodes[-20:]])) if episodes else 0.0, 2),
        "env_steps": int(pipeline.get("env_steps", 0)),
        "trained_steps": state.trained_steps,
        "wall_s": round(wall_s, 1),
        "max_staleness_seen": state.max_staleness_seen,
        "buffer_stale_dropped": int((buffer_status or {}).get("stale_dropped_total", 0)),
        "policy_version": state.version,
        "episodes": len(episodes),
        "episodes_missed": monitor.episodes_missed,
        "worker_restarts": sum(fleet_status.get("restarts", [])),
        "env_restarts": sum(int(w.get("env_restarts", 0)) for w in fleet_status.get("workers", [])),
        "stop_reason": reason,
        "stopped_by": stopped_by,
        "pipeline_s": {stage: round(pipeline.get(f"{stage}_s", 0.0), 2) for stage in STAGES},
        "mean_inference_batch": round(pipeline.get("inference_obs", 0) / max(pipeline.get("forward_passes", 0), 1), 2),
        "curve_png": os.fspath(png),
        "run_dir": os.fspath(rundir.root),
    }
    return monitor.write_summary(summary)
