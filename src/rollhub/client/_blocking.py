"""The blocking face of the clients: the one (coroutine) implementation, run to its end in the calling thread.

A blocking class holds a core built in the blocking I/O mode (``Http(blocking=True)``: ``httpx.Client`` and
``time.sleep``), whose coroutines therefore never suspend. Each blocking method is a one-line delegate made by
:func:`blocking`, which creates the core method's coroutine and :func:`drive`\\ s it: no event loop, no thread
hop, and callbacks (``on_retry``, ``collect``) run in the calling thread, as a blocking call should.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def drive(coro: Coroutine[Any, Any, R]) -> R:
    """Run a coroutine whose I/O blocks (it never suspends) to its end; return its result or raise its error.

    Raises:
        RuntimeError: the coroutine suspended, i.e. awaited real asyncio I/O: it was not built in the
            blocking mode (a defect, not a caller error).
    """
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError(f"{coro.__qualname__} awaited asyncio I/O; a blocking client must be built with blocking=True")


def blocking(
    method: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[BlockingFace, P], R]:
    """The blocking form of a client coroutine method: same name, arguments, docstring, result and errors."""

    @functools.wraps(method)
    def call(self: BlockingFace, *args: P.args, **kwargs: P.kwargs) -> R:
        return drive(method(self.core, *args, **kwargs))

    return call


class BlockingFace:
    """Base of a blocking client: its core (an async client class built with ``blocking=True``) is ``core``."""

    core: Any

    def close(self) -> None:
        """Close the connections of this client."""
        drive(self.core.aclose())

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
