"""The fleet's episode statistics keep a bounded history, and the run reads every episode of it, or says what it
could not."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.run.run_process import CORRIDOR

from rollhub.errors import ConfigError
from rollhub.rollout.protocols import EpisodeResult
from rollhub.rollout.stats import EpisodeStatistics
from rollhub.run.config import load_config, read_toml
from rollhub.run.monitor import RunMonitor
from rollhub.run.rundir import EPISODES, RunDirectory
from rollhub.run.signals import StopSignals
from rollhub.train.ppo import PPOLearner


def _episodes(first: int, n: int) -> list[EpisodeResult]:
    return [EpisodeResult("t", float(first + i), 0.0, 2, True, 0) for i in range(n)]


def test_the_history_keeps_the_newest_episodes_and_counts_them_all() -> None:
    stats = EpisodeStatistics(window=5, keep=10)
    for first in range(0, 35, 5):
        assert stats.record(_episodes(first, 5)) == first + 5
    kept = stats.history()
    indices = [e.index for e in kept]
    assert 10 <= len(kept) <= 20 and indices == list(range(35 - len(kept), 35)), indices
    assert [e.ret for e in kept] == [float(i) for i in indices]  # each record is still its own episode
    assert [e.index for e in stats.history(30)] == [30, 31, 32, 33, 34]
    assert stats.history(35) == [] and stats.history(0)[0].index > 0  # older than the oldest kept: from there
    assert stats.summary()["t"]["count"] == 35 and stats.recent_returns(3) == [32.0, 33.0, 34.0]


def test_a_history_that_keeps_nothing_is_refused() -> None:
    with pytest.raises(ConfigError, match="keep must be >= 1"):
        EpisodeStatistics(keep=0)


def test_the_run_writes_every_episode_it_reads_and_counts_those_it_missed(tmp_path: Path) -> None:
    config = load_config(read_toml(CORRIDOR), ["run.progress=false"])
    rundir = RunDirectory(tmp_path)
    stats = EpisodeStatistics(keep=4)
    monitor = RunMonitor(config.run, rundir, PPOLearner(2, 2), stats, StopSignals())
    stats.record(_episodes(0, 3))
    monitor._collect_episodes(version=1)
    stats.record(_episodes(3, 20))  # more than twice keep before the next read: the oldest are forgotten
    monitor._collect_episodes(version=2)
    rows = rundir.read(EPISODES)
    forgotten = stats.history(0)[0].index - 3
    assert forgotten > 0 and monitor.episodes_missed == forgotten
    assert [r["return"] for r in rows] == [0.0, 1.0, 2.0] + [float(i) for i in range(3 + forgotten, 23)]
    assert [r["index"] for r in rows] == list(range(len(rows))) and monitor.episode_count == len(rows)
    assert rows[-1]["env_steps"] == 2 * len(rows) == monitor.env_steps
    stats.record(_episodes(23, 1))
    monitor._collect_episodes(version=3)  # caught up: nothing more is missed
    assert monitor.episodes_missed == forgotten and rundir.read(EPISODES)[-1]["return"] == 23.0
