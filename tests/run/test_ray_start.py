"""The Ray runtime a run starts: its worker processes run at the driver's priority unless the environment says
otherwise (without starting Ray: ``ray.init`` is replaced by a recorder)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import ray

from rollhub.run.step_parts import WORKER_NICENESS_ENV, start_ray


class Stop:
    installed = 0

    def install(self) -> None:
        self.installed += 1


def _recorded(monkeypatch: pytest.MonkeyPatch, running: bool = False) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: running)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append({**kw, "niceness": os.environ.get(WORKER_NICENESS_ENV)}))
    return calls


def test_the_started_runtime_runs_its_workers_at_the_drivers_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_NICENESS_ENV, raising=False)
    calls, stop = _recorded(monkeypatch), Stop()
    assert start_ray(3, stop) is True
    assert calls[0]["niceness"] == "0" and calls[0]["num_cpus"] == 3 and stop.installed == 1


def test_a_niceness_the_environment_sets_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKER_NICENESS_ENV, "7")
    calls = _recorded(monkeypatch)
    start_ray(2, Stop())
    assert calls[0]["niceness"] == "7"


def test_a_running_runtime_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_NICENESS_ENV, raising=False)
    calls = _recorded(monkeypatch, running=True)
    assert start_ray(2, Stop()) is False
    assert calls == [] and WORKER_NICENESS_ENV not in os.environ
