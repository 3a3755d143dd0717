"""The learning curve names the fleet that really ran."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.axes
import pytest

from rollhub.run.config import load_config
from rollhub.run.main import shipped_config
from rollhub.run.report import plot_curve


@pytest.mark.parametrize(
    ("backend", "fleet"),
    [
        ("ray", "Ray rollout fleet"),
        ("local", "local rollout fleet (threads, no Ray)"),
        ("processes", "rollout fleet of processes (no Ray)"),
    ],
)
def test_the_learning_curve_title_names_the_backend_that_ran(
    backend: str, fleet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    titles: list[str] = []
    draw = matplotlib.axes.Axes.set_title

    def recorded(self: Any, label: str, *args: Any, **kwargs: Any) -> Any:
        titles.append(label)
        return draw(self, label, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", recorded)
    config = load_config(shipped_config("cartpole"), [f"fleet.backend={backend!r}"])
    episodes = [{"return": float(i), "env_steps": 10 * i} for i in range(1, 30)]
    plot_curve(episodes, config, tmp_path / "curve.png", [{"version": 1, "staleness": 0}])
    assert titles == [f"PPO on CartPole-v1, {fleet}"]
    assert (tmp_path / "curve.png").stat().st_size > 1000
