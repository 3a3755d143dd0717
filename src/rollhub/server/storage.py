"""The buffer storage the server builds: scored groups written with the wire's group codec.

The buffer encodes nothing itself (:class:`rollhub.buffer.storage.Codec`); the server, which owns the wire format,
gives its durable backend the compact group encoding of :mod:`rollhub.wire.codec`: int32 tokens and masks, float32
log-probs. A group that arrived in that encoding is stored in the very bytes it arrived as.
"""

from __future__ import annotations

from rollhub.buffer import Codec, Storage, make_storage
from rollhub.wire.codec import pack_group, unpack_stored_group

GROUP_CODEC = Codec(pack_group, unpack_stored_group, holds="scored groups", reuses_wire=True)
"""Scored groups as the wire's binary group encoding (:func:`rollhub.wire.codec.pack_group`)."""


def make_group_storage(url: str) -> Storage:
    """The storage ``url`` names (``memory`` or ``sqlite:///path.db``), holding scored groups."""
    return make_storage(url, GROUP_CODEC)
