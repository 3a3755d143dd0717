"""Runs inside every process of a vLLM engine rollhub starts (not imported by rollhub itself): a cap on how long
the process's shared-memory queue readers busy-wait after a message, and on how long a sleeping reader goes
without looking at its queue (:data:`RECHECK_MS`).

Importing this module with :data:`SPIN_ENV` set (rollhub sets it, ``inference.worker_spin_s``) applies the cap
(:func:`shorten_spin`) to the importing process. The launcher (:mod:`rollhub_vllm_serve`) imports it, and so do
the processes vLLM spawns from it (the engine core, the model workers); the worker extension
(:mod:`rollhub_vllm_worker`) imports it too. Only the standard library and vLLM's queue module are imported here.
"""

from __future__ import annotations

import os
from typing import Any

SPIN_ENV = "ROLLHUB_VLLM_SPIN_S"  # seconds a process's queue readers busy-wait after a message; unset: vLLM's (1 s)
RECHECK_MS = 50  # with the cap, the longest a sleeping reader goes before it looks at its queue again; vLLM's: 5,000
RECHECK_ENV = "ROLLHUB_VLLM_RECHECK_MS"  # replaces RECHECK_MS where the cap applies; 5000 gives vLLM's recheck back


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


def recheck_cap() -> int | None:
    """The longest, in ms, this process's sleeping queue readers go before they look again (``None``: vLLM's)."""
    return getattr(getattr(_queue_reader(), "wait", None), "_rollhub_recheck_ms", None)


def shorten_spin(spin_s: float, recheck_ms: int = RECHECK_MS) -> bool:
    """Cap how long this process's shared-memory queue readers busy-wait after a message at ``spin_s`` seconds.

    vLLM's readers (``SpinCondition`` in ``vllm.distributed.device_communicators.shm_broadcast``) spin with
    ``sched_yield`` for a second after every read before they sleep on a socket that wakes them at the next
    write. A model worker of an engine that samples every second or two therefore never sleeps, and on a CPU the
    trainer shares it takes a core the trainer needs. Past the cap the reader sleeps on that socket, which costs
    one wake-up (microseconds) when the next message comes.

    The sleep itself is capped too, at ``recheck_ms``. The socket's wake-up can be lost (the writer's side keeps
    at most one unsent notice and drops the next), and a reader whose wake-up was lost sleeps until vLLM's
    recheck, 5 s later, with the message already in its queue: an engine step then takes 5 s instead of a tenth
    of one. vLLM's own readers rarely sleep while an engine samples, so they rarely meet it; readers under the
    cap sleep in nearly every step. With the recheck capped at :data:`RECHECK_MS` (50 ms, unless
    :data:`RECHECK_ENV` says otherwise), a lost wake-up costs at most that, and an idle reader looks at its queue
    20 times a second. Returns whether the reader was found (an engine without it
    is left as it is); a second call changes the cap.
    """
    reader = _queue_reader()
    if reader is None:
        return False
    wait = getattr(reader.wait, "_rollhub_original", reader.wait)

    def capped_wait(self: Any, timeout_ms: int | None = None) -> Any:
        if getattr(self, "busy_loop_s", 0) > spin_s:
            self.busy_loop_s = spin_s
        return wait(self, timeout_ms=recheck_ms if timeout_ms is None else min(timeout_ms, recheck_ms))

    capped_wait._rollhub_spin_s = spin_s  # type: ignore[attr-defined]
    capped_wait._rollhub_recheck_ms = recheck_ms  # type: ignore[attr-defined]
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
    recheck = os.environ.get(RECHECK_ENV) or str(RECHECK_MS)
    if not (recheck.isdigit() and int(recheck) > 0):
        raise ValueError(
            f"{RECHECK_ENV}={recheck!r}: give the whole milliseconds (> 0) a sleeping queue reader waits before it "
            f"looks again ({RECHECK_MS} unless set; 5000 is vLLM's own), or leave it unset"
        )
    shorten_spin(spin_s, int(recheck))


_spin_from_env()
