"""The demos' progress display and stop flag, as plain Python."""

from __future__ import annotations

import io
import os
import re
import signal

import pytest

from rollhub.run.progress import Progress, number, say, share
from rollhub.run.signals import StopSignals

LONG = {"held-out acc": "0.52 (best 0.55)", "step": "1234/4000", "reward": "0.61", "staleness": "1.3", "x": "y" * 90}


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def percents(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"\b(\d{1,3})% \[", text)]


def test_plain_lines_fit_80_columns_and_have_no_carriage_return() -> None:
    out = io.StringIO()
    bar = Progress("arithmetic", stream=out, plain_interval_s=0.0)
    for i in range(5):
        bar.update(i / 10, **LONG)
    bar.close("limit reached", **LONG)
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 6  # one plain line per update (interval 0) and the final one
    assert all(len(line) <= 80 for line in lines)
    assert "limit reached" in lines[-1]


def test_plain_lines_come_at_most_once_per_interval() -> None:
    out = io.StringIO()
    bar = Progress("buffer", stream=out, plain_interval_s=3600.0)
    for i in range(50):
        bar.update(i / 50, batches=i)
    assert len(out.getvalue().splitlines()) == 1  # the first update draws, the rest fall within the hour


def test_terminal_line_is_cut_to_the_given_width() -> None:
    out = FakeTerminal()
    bar = Progress("cartpole", stream=out, interval_s=0.0, width=79)
    bar.update(0.3, **LONG)
    bar.close("target reached", reached=True, **LONG)
    drawn = [part.removesuffix("\x1b[K") for part in out.getvalue().strip("\n").split("\r") if part]
    assert len(drawn) == 2 and all(0 < len(line) <= 79 for line in drawn)
    assert out.getvalue().endswith("\n")


def test_default_width_off_a_terminal_is_80(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert Progress("x", stream=io.StringIO()).width == 80
    assert Progress("x", stream=FakeTerminal()).width == 199


def test_bar_never_runs_backwards() -> None:
    out = io.StringIO()
    bar = Progress("arithmetic", stream=out, plain_interval_s=0.0)
    for fraction in (0.1, 0.5, 0.2, 0.0, 0.6, 0.3):
        bar.update(fraction)
    shown = percents(out.getvalue())
    assert shown == [10, 50, 50, 50, 60, 60]
    assert bar.fraction == pytest.approx(0.6)


def test_final_line_reads_100_percent_when_the_goal_is_reached() -> None:
    out = io.StringIO()
    bar = Progress("buffer", stream=out, plain_interval_s=0.0)
    bar.update(0.819)
    bar.close("done", reached=True)
    assert percents(out.getvalue())[-1] == 100
    stopped = io.StringIO()
    bar = Progress("buffer", stream=stopped, plain_interval_s=0.0)
    bar.update(0.4)
    bar.close("stopped by SIGINT")
    assert percents(stopped.getvalue())[-1] == 40 and "stopped by SIGINT" in stopped.getvalue()


def test_share_clamps_and_tolerates_a_zero_limit() -> None:
    assert share(5, 10) == 0.5 and share(20, 10) == 1.0 and share(-1, 10) == 0.0 and share(3, 0) == 0.0


def test_say_writes_one_flushed_line() -> None:
    out = io.StringIO()
    say("starting Ray (2 CPUs)...", out)
    assert out.getvalue() == "starting Ray (2 CPUs)...\n"


def test_stop_signals_turn_sigterm_into_a_flag_and_restore_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert not stop.requested and stop.exit_code == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM" and stop.exit_code == 128 + signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second signal stops at once
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_narrow_line_drops_whole_fields_never_digits() -> None:
    fields = {"return": "12.3 (best 15.0)", "steps": "44,272", "version": 123, "stale": 1}
    for width in (80, 60, 52, 45):
        out = io.StringIO()
        bar = Progress("a-rather-long-run-name", stream=out, plain_interval_s=0.0, width=width)
        bar.update(0.25, **fields)
        bar.close("time limit", fraction=0.2, **fields)
        for line in out.getvalue().splitlines():
            assert len(line) <= width, (width, line)
            shown = [k for k in fields if f"  {k} " in line]
            assert all(f"  {k} {fields[k]}" in line for k in shown), (width, line)  # each field whole or absent
            assert shown == list(fields)[: len(shown)], (width, line)  # dropped from the end
        assert "time limit" in out.getvalue().splitlines()[-1] or width < 57  # the state goes only when it must
    terminal = FakeTerminal()
    bar = Progress("cartpole", stream=terminal, interval_s=0.0, width=72)
    bar.update(0.5, **fields)
    drawn = [part.removesuffix("\x1b[K") for part in terminal.getvalue().split("\r") if part.strip()]
    assert drawn and all(len(line) <= 72 and line.endswith("steps 44,272") for line in drawn), drawn


def test_numbers_keep_sensible_precision() -> None:
    assert [number(v) for v in (0.6, 0.0, -0.25, 12.34, 475.3, 44272, 44272.0, 7)] == [
        "0.60", "0.00", "-0.25", "12.3", "475", "44,272", "44,272", "7",
    ]  # fmt: skip


def test_only_a_run_that_did_what_it_set_out_to_do_reads_100_percent() -> None:
    out = io.StringIO()
    bar = Progress("cartpole", stream=out, plain_interval_s=0.0)
    bar.update(0.996)  # the time share, just before the time limit ends the run
    bar.close("time limit", fraction=0.63)  # how far it got toward its target
    assert percents(out.getvalue()) == [99, 63]  # rounded down: 99.6% is not 100%
    out = io.StringIO()
    bar = Progress("cartpole", stream=out, plain_interval_s=0.0)
    bar.close("time limit", fraction=1.0)
    bar.close("update limit", reached=True)
    assert percents(out.getvalue()) == [99, 100]
