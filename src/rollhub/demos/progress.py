"""The demos' progress display: a tqdm bar on a terminal, and plain lines when not on one.

The bar measures progress toward the run's stopping condition and never runs backwards: a run passes the
share of each limit it has used (the best value reached so far over the target, steps over the step limit,
seconds over the time limit) and the bar shows the largest share ever passed, because the run stops when the
first of them is complete. On a terminal tqdm redraws the line in place at most every ``interval_s``, cut to
the terminal's width; when the stream is not a terminal (a file, a pipe, a CI log) the same line, rendered by
tqdm's formatter, is written as one plain line of at most 80 columns every ``plain_interval_s``, with no
carriage return and no escape sequence.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

from tqdm import tqdm

BAR_WIDTH = 12
PLAIN_WIDTH = 80
_STEPS = 1000  # the bar's resolution: fractions are shown as n / _STEPS


def say(message: str, stream: TextIO | None = None) -> None:
    """Print one line of what the demo is doing now (e.g. ``starting Ray (2 CPUs)...``), flushed at once."""
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
        return f"{head} {{percentage:3.0f}}% [{{bar:{BAR_WIDTH}}}] {{elapsed_s:.0f}}s" + (f"  {tail}" if tail else "")

    def line(self, fields: dict[str, object], state: str | None = None) -> str:
        """The status line for ``fields`` (``name value`` pairs), cut to ``width`` columns (tqdm's formatter)."""
        return tqdm.format_meter(
            round(self.fraction * _STEPS),
            _STEPS,
            time.monotonic() - self._start,
            ncols=self.width,
            bar_format=self._format(fields, state),
            ascii="-#",
        )

    def update(self, fraction: float, **fields: object) -> None:
        """Record progress ``fraction`` (0..1; the bar keeps the largest seen) and redraw if it is time."""
        self.fraction = max(self.fraction, min(1.0, max(0.0, fraction)))
        now = time.monotonic()
        if now - self._last_draw < self.interval_s:
            return
        self._last_draw = now
        self._draw(fields, None)

    def close(self, state: str, reached: bool = False, fraction: float = 0.0, **fields: object) -> None:
        """Draw the final line, ending with a newline: 100% when ``reached`` (the goal was met), else the
        largest of ``fraction`` and every fraction seen; ``state`` says how the run ended (``"target
        reached"``, ``"stopped by SIGINT"``)."""
        self.fraction = 1.0 if reached else max(self.fraction, min(1.0, max(0.0, fraction)))
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
        self._bar.bar_format = self._format(fields, state)
        self._bar.ascii = "-#"
        self._bar.n = round(self.fraction * _STEPS)
        self._bar.refresh()
