"""The progress display of runs and demos: a tqdm bar on a terminal, and plain lines when not on one.

What the percentage means: how near the run is to its first stopping condition. A run passes the share of
each condition it has used (the best value reached so far over its target, updates over the update limit,
seconds over the time limit) and the bar shows the largest share ever passed, since the run stops when the
first of them is complete; so it never runs backwards. The percentage is rounded down, and it reads 100% only
when the run did what it set out to do (reached its target or its update limit): a run that a time limit or a
signal ends shows how far it got toward its target or update limit instead (see :meth:`Progress.close`).

On a terminal tqdm redraws the line in place at most every ``interval_s``; when the stream is not a terminal (a
file, a pipe, a CI log) the same line is written as one plain line of at most 80 columns every
``plain_interval_s``, with no carriage return and no escape sequence. A line too long for its width loses whole
fields from its end, never part of a value.
"""

from __future__ import annotations

import math
import numbers
import shutil
import sys
import time
from typing import TextIO

from tqdm import tqdm

BAR_WIDTH = 12
PLAIN_WIDTH = 80
_STEPS = 1000  # the bar's resolution: fractions are shown as n / _STEPS
PERCENT_HELP = (
    "its percentage is how near the run is to its first stopping condition (target, update limit, time limit); "
    "100%% only when the target or the update limit was reached"
)
"""What the progress line's percentage means, for the ``--help`` of every command that draws one (``%`` doubled
for argparse)."""


def number(value: float) -> str:
    """``value`` as a progress line shows it: whole numbers with thousands separators (``44,272``), others to
    three significant figures or so (``0.60``, ``12.3``, ``475``), so that small returns do not round to 0 or 1."""
    if isinstance(value, numbers.Integral) or (float(value).is_integer() and abs(value) >= 1000):
        return f"{int(value):,}"
    size = abs(value)
    return f"{value:,.0f}" if size >= 100 else f"{value:.1f}" if size >= 10 else f"{value:.2f}"


def say(message: str, stream: TextIO | None = None) -> None:
    """Print one line of what the run is doing now (e.g. ``starting Ray (2 CPUs)...``), flushed at once."""
    out = stream or sys.stderr
    out.write(message + "\n")
    out.flush()


def share(done: float, limit: float) -> float:
    """``done / limit`` clamped to ``[0, 1]`` (0 when ``limit`` is not positive)."""
    if limit <= 0:
        return 0.0
    return min(1.0, max(0.0, done / limit))


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


class Progress:
    """A progress line toward whichever stopping condition finishes first.

    Args:
        label: the first word of the line (the run's name).
        stream: where the line goes (stderr by default; stdout carries the JSON summary).
        interval_s: the shortest time between redraws on a terminal.
        plain_interval_s: the time between plain lines when ``stream`` is not a terminal.
        width: the widest line; by default the terminal's width less one column, or 80 off a terminal.
    """

    def __init__(
        self,
        label: str,
        stream: TextIO | None = None,
        interval_s: float = 0.25,
        plain_interval_s: float = 5.0,
        width: int | None = None,
    ) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.interval_s = interval_s if self.tty else plain_interval_s
        columns = shutil.get_terminal_size((PLAIN_WIDTH, 24)).columns - 1 if self.tty else PLAIN_WIDTH
        self.width = width or max(20, columns)
        self.fraction = 0.0
        self._start = time.monotonic()
        self._last_draw = -float("inf")
        self._bar: tqdm | None = None
        if self.tty:
            # delay: nothing is drawn before the first update; the run's own lines come first.
            self._bar = tqdm(total=_STEPS, file=self.stream, ncols=self.width, mininterval=0, delay=1e9, leave=True)

    def _format(self, fields: dict[str, object], state: str | None) -> str:
        parts = [*((state and [state]) or []), *(f"{k} {v}" for k, v in fields.items())]
        tail = _escape("  ".join(parts))
        head = _escape(self.label)
        percent = math.floor(self.fraction * 100 + 1e-9)
        return f"{head} {percent:3d}% [{{bar:{BAR_WIDTH}}}] {{elapsed_s:.0f}}s" + (f"  {tail}" if tail else "")

    def _render(self, fields: dict[str, object], state: str | None, ncols: int | None) -> str:
        return tqdm.format_meter(
            math.floor(self.fraction * _STEPS + 1e-9),
            _STEPS,
            time.monotonic() - self._start,
            ncols=ncols,
            bar_format=self._format(fields, state),
            ascii="-#",
        )

    def _fit(self, fields: dict[str, object], state: str | None, width: int) -> dict[str, object]:
        """``fields`` less as many of its last fields as the line needs to fit ``width`` columns."""
        kept = dict(fields)
        while kept and len(self._render(kept, state, None)) > width:
            kept.popitem()
        return kept

    def line(self, fields: dict[str, object], state: str | None = None) -> str:
        """The status line for ``fields`` (``name value`` pairs) in ``width`` columns: the fields that do not fit
        are left out whole, from the last; only a label and state too long by themselves are cut."""
        return self._render(self._fit(fields, state, self.width), state, self.width)

    def update(self, fraction: float, **fields: object) -> None:
        """Record progress ``fraction`` (0..1; the bar keeps the largest seen) and redraw if it is time."""
        self.fraction = max(self.fraction, min(1.0, max(0.0, fraction)))
        now = time.monotonic()
        if now - self._last_draw < self.interval_s:
            return
        self._last_draw = now
        self._draw(fields, None)

    def close(self, state: str, reached: bool = False, fraction: float | None = None, **fields: object) -> None:
        """Draw the final line, ending with a newline; ``state`` says how the run ended (``"target reached"``,
        ``"stopped by SIGINT"``). It reads 100% when ``reached`` (the run did what it set out to do), and never
        otherwise: then ``fraction``, how far the run got toward its goal (the share of its target or update
        limit; a time limit that ended it is no progress toward them), or without one the largest fraction seen,
        at most 99%."""
        got = max(self.fraction, 0.0) if fraction is None else min(1.0, max(0.0, fraction))
        self.fraction = 1.0 if reached else min(got, 0.99)
        self._draw(fields, state)
        if self._bar is not None:
            self._bar.close()  # writes nothing more: its delay keeps tqdm's own first and last draws off
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, fields: dict[str, object], state: str | None) -> None:
        if self._bar is None:
            self.stream.write(self.line(fields, state) + "\n")
            self.stream.flush()
            return
        # one column spare: tqdm's own clock may show one more digit of elapsed seconds than this one
        self._bar.bar_format = self._format(self._fit(fields, state, self.width - 1), state)
        self._bar.ascii = "-#"
        self._bar.n = math.floor(self.fraction * _STEPS + 1e-9)
        self._bar.refresh()
