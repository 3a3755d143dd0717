"""Ingest as every route does it: decode the body, store its groups (on the storage thread), wake long-polls.

``POST /scored_data`` and ``/scored_data_list`` (:mod:`rollhub.server.routes.atropos`) and the binary fast
path (:mod:`rollhub.server.fastpath`) all call one :class:`Ingest`; only the way the body was read differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollhub.buffer import ExperienceBuffer
from rollhub.server import shapes
from rollhub.server.worker import StorageThread
from rollhub.wire.ingest import Body, decode_groups


class Ingest:
    """Decode and store one ingest body; the answer is the route's JSON object.

    Args:
        buffer: where the groups go.
        thread: the storage thread the buffer call runs on. Decoding stays on the event loop: it is CPU work
            that holds the interpreter lock, so on the thread it only made the loop contend for the lock
            (measured: JSON ingest into SQLite about a quarter slower that way).
        check_advantage_lengths: require advantage rows as long as token rows.
        arrived: called on the event loop after every successful ingest (wakes long-polling trainers).
    """

    def __init__(
        self,
        buffer: ExperienceBuffer,
        thread: StorageThread,
        check_advantage_lengths: bool,
        arrived: Callable[[], None],
    ) -> None:
        self.buffer = buffer
        self.thread = thread
        self.strict = check_advantage_lengths
        self.arrived = arrived

    async def __call__(self, body: Body, content_type: str, *, many: bool) -> dict[str, Any]:
        """The answer to ingesting ``body`` (one group, or a list with ``many``); raises what decoding or the
        buffer raise (:class:`~rollhub.wire.ingest.BodyInvalid`, ``QueueFull``, ...), nothing stored then."""
        groups = decode_groups(body, content_type, many=many, check_advantage_lengths=self.strict)
        results = await self.thread.run(self.buffer.ingest, groups)
        self.arrived()
        return shapes.scored_data_list(results) if many else shapes.scored_data(results[0])
