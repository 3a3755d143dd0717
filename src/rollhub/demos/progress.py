"""A one-line live progress display for the demos (no dependency; plain text when not on a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Redraws one status line at most every ``interval_s``; ``close()`` ends the line."""

    def __init__(self, total: float, label: str, stream: TextIO | None = None, interval_s: float = 0.2) -> None:
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.tty = self.stream.isatty()
        self._last = 0.0
        self._start = time.monotonic()

    def update(self, done: float, **fields: object) -> None:
        now = time.monotonic()
        if now - self._last < (self.interval_s if self.tty else 2.0):
            return
        self._last = now
        frac = min(1.0, done / self.total) if self.total else 0.0
        bar = "#" * int(frac * 24) + "-" * (24 - int(frac * 24))
        info = "  ".join(f"{k}={v}" for k, v in fields.items())
        line = f"{self.label} [{bar}] {frac * 100:5.1f}%  {info}  {now - self._start:5.1f}s"
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
