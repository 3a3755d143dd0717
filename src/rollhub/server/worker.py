"""The storage thread: buffer calls that may touch storage run here, never on the event loop.

A SQLite commit (``fsync`` with ``synchronous=full``, a WAL checkpoint, a full disk) can take milliseconds to
seconds; on the event loop it would stall every connection, ``/health`` included. Every route therefore hands
its buffer call to one dedicated thread and awaits it. One thread, not a pool: the buffer core serializes its
calls under its own lock anyway, so more threads would only wait there, and one thread keeps the calls in the
order the requests reached it.

Storage that is not durable (``memory``) writes nothing to disk and never blocks: its calls run inline on the
loop (``inline=True``), where a thread hop would cost more than the call itself.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

#: The interpreter's thread switch interval while a storage thread runs. When SQLite returns, the storage
#: thread needs the interpreter lock back from the event loop, which keeps it for up to this long while it
#: decodes the next request; Python's default (5 ms) made the two threads wait on each other.
SWITCH_INTERVAL_S = 0.0005

P = ParamSpec("P")
T = TypeVar("T")


class StorageThread:
    """Runs blocking buffer calls on one worker thread for the event loop (``await thread.run(fn, *args)``).

    Args:
        inline: run every call directly on the caller's thread instead (for storage that never blocks).
    """

    def __init__(self, *, inline: bool = False) -> None:
        self.inline = inline
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the storage thread; its result or exception comes back to the caller."""
        if self.inline:
            return fn(*args, **kwargs)
        if self._pool is None:  # started on first use, and again after close (an app served twice)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollhub-storage")
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        call = functools.partial(fn, *args, **kwargs) if kwargs else fn
        return await asyncio.get_running_loop().run_in_executor(self._pool, call, *(() if kwargs else args))

    def close(self) -> None:
        """Finish the calls already handed over, then stop the thread (a later call starts a new one)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
