"""Runs inside every process of a vLLM engine rollhub starts (not imported by rollhub itself): a cap on how long
the process's shared-memory queue readers busy-wait after a message.

Importing this module with :data:`SPIN_ENV` set (rollhub sets it, ``inference.worker_spin_s``) applies the cap
(:func:`shorten_spin`) to the importing process. The launcher (:mod:`rollhub_vllm_serve`) imports it, and so do
the processes vLLM spawns from it (the engine core, the model workers); the worker extension
(:mod:`rollhub_vllm_worker`) imports it too. Only the standard library and vLLM's queue module are imported here.
"""

from __future__ import annotations

import os
from typing import Any

SPIN_ENV = "ROLLHUB_VLLM_SPIN_S"  # seconds a process's queue readers busy-wait after a message; unset: vLLM's (1 s)


def _queue_reader() -> Any:
    """vLLM's shared-memory queue reader class (``SpinCondition``), or ``None`` where this vLLM has none."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return None
    reader = getattr(shm_broadcast, "SpinCondition", None)
    return reader if callable(getattr(reader, "wait", None)) else None


def spin_cap() -> float | None:
    """The cap this process's queue readers run under (``None``: none was set, or vLLM's queue was not found)."""
    return getattr(getattr(_queue_reader(), "wait", None), "_rollhub_spin_s", None)


def shorten_spin(spin_s: float) -> bool:
    """Cap how long this process's shared-memory queue readers busy-wait after a message at ``spin_s`` seconds.

    vLLM's readers (``SpinCondition`` in ``vllm.distributed.device_communicators.shm_broadcast``) spin with
    ``sched_yield`` for a second after every read before they sleep on a socket that wakes them at the next
    write. A model worker of an engine that samples every second or two therefore never sleeps, and on a CPU the
    trainer shares it takes a core the trainer needs. Past the cap the reader sleeps on that socket, which costs
    one wake-up (microseconds) when the next message comes. Returns whether the reader was found (an engine
    without it is left as it is); a second call changes the cap.
    """
    reader = _queue_reader()
    if reader is None:
        return False
    wait = getattr(reader.wait, "_rollhub_original", reader.wait)

    def capped_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "busy_loop_s", 0) > spin_s:
            self.busy_loop_s = spin_s
        return wait(self, *args, **kwargs)

    capped_wait._rollhub_spin_s = spin_s  # type: ignore[attr-defined]
    capped_wait._rollhub_original = wait  # type: ignore[attr-defined]
    reader.wait = capped_wait
    return True


def _spin_from_env() -> None:
    given = os.environ.get(SPIN_ENV)
    if not given:
        return
    try:
        spin_s = float(given)
    except ValueError:
        spin_s = -1.0
    if not spin_s >= 0:
        raise ValueError(f"{SPIN_ENV}={given!r}: give the seconds a worker may busy-wait (>= 0), or leave it unset")
    shorten_spin(spin_s)


_spin_from_env()
