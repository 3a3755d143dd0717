"""The demos' progress display: one status line that fits the terminal, and plain lines when not on one.

The bar measures progress toward the demo's stopping condition and never runs backwards: a demo passes the
share of each limit it has used (the best value reached so far over the target, steps over the step limit,
seconds over the time limit) and the bar shows the largest share ever passed, because the run stops when the
first of them is complete. On a terminal the line is redrawn in place (carriage return) at most every
``interval_s`` and cut to the terminal's width; when the stream is not a terminal (a file, a pipe, a CI log)
it writes one plain line, at most 80 columns, every ``plain_interval_s``, and never a carriage return.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

BAR_WIDTH = 12
PLAIN_WIDTH = 80


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


class Progress:
    """A progress line toward whichever stopping condition finishes first.

    Args:
        label: the first word of the line (the demo's name).
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

    def line(self, fields: dict[str, object], state: str | None = None) -> str:
        """The status line for ``fields`` (``name value`` pairs), cut to ``width`` columns."""
        filled = int(self.fraction * BAR_WIDTH)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        head = f"{self.label} {self.fraction * 100:3.0f}% [{bar}] {time.monotonic() - self._start:.0f}s"
        parts = [head, *((state and [state]) or []), *(f"{k} {v}" for k, v in fields.items())]
        text = "  ".join(parts)
        return text if len(text) <= self.width else text[: self.width - 1] + "~"

    def update(self, fraction: float, **fields: object) -> None:
        """Record progress ``fraction`` (0..1; the bar keeps the largest seen) and redraw if it is time."""
        self.fraction = max(self.fraction, min(1.0, max(0.0, fraction)))
        now = time.monotonic()
        if now - self._last_draw < self.interval_s:
            return
        self._last_draw = now
        self._write(self.line(fields))

    def close(self, state: str, reached: bool = False, fraction: float = 0.0, **fields: object) -> None:
        """Draw the final line, ending with a newline: 100% when ``reached`` (the goal was met), else the
        largest of ``fraction`` and every fraction seen; ``state`` says how the run ended (``"target
        reached"``, ``"stopped by SIGINT"``)."""
        self.fraction = 1.0 if reached else max(self.fraction, min(1.0, max(0.0, fraction)))
        self._write(self.line(fields, state))
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _write(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text + "\x1b[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
