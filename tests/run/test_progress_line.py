"""``rollhub run``'s progress line at its end: a time limit is not 100%."""

from __future__ import annotations

import re
from pathlib import Path

from tests.run.run_process import CORRIDOR, rollhub_run, summary_of


def test_a_run_ended_by_its_time_limit_does_not_read_100_percent(tmp_path: Path) -> None:
    sets = [f"run.dir={str(tmp_path / 'run')!r}", "fleet.backend='local'", "run.progress=true",
            "run.max_seconds=5", "run.target_return=5.0"]  # fmt: skip
    done = rollhub_run(str(CORRIDOR), *(part for s in sets for part in ("--set", s)), timeout_s=240)
    assert done.returncode == 1, done.stderr[-3000:]  # a limit came first
    assert summary_of(done)["stop_reason"] == "time limit"
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("corridor ") and "time limit" in last and "  return " in last, last
    percent = int(re.search(r"(\d+)% \[", last).group(1))
    assert percent < 100, last  # the share of the target reached: the best return (at most 0.6) over 5
    assert len(last) <= 80
