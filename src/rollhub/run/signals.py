"""Stopping a run cleanly: SIGINT, SIGTERM and SIGHUP become a flag that the training loop polls.

A run (or a demo) installs :class:`StopSignals` in its driver (after ``ray.init``, whose runtime installs handlers
of its own that dump a stack on SIGTERM), checks :attr:`StopSignals.requested` once per loop turn, and on a request
leaves the loop, stops the fleet, Ray and any child server in order, and still writes its summary and PNG.
A second signal while the first is being honoured raises :class:`KeyboardInterrupt` (stop at once).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignals:
    """A stop flag set by SIGINT, SIGTERM or SIGHUP while installed (a context manager; main thread only).

    Attributes:
        signal_name: the name of the first signal received (``"SIGTERM"``), or None.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return self.signal_name is not None

    @property
    def exit_code(self) -> int:
        """``128 + signal number`` after a stop request (the shell's convention), else 0."""
        return 128 + int(signal.Signals[self.signal_name]) if self.signal_name else 0

    def install(self) -> StopSignals:
        """(Re)install the handlers, keeping the first handlers found for :meth:`restore`; a no-op off the
        main thread, where Python cannot handle signals."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        return self

    def restore(self) -> None:
        """Put back the handlers found by the first :meth:`install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None:
            raise KeyboardInterrupt(f"second stop signal ({signal.Signals(signum).name}): stopping at once")
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()
