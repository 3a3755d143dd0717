"""The one factory for the buffer's storage backends, chosen by URL (:mod:`rollhub.buffer.storage`: the interface
and the memory backend; :mod:`rollhub.buffer.sqlite`: the durable one)."""

from __future__ import annotations

from rollhub.buffer.sqlite import SqliteStorage
from rollhub.buffer.storage import Codec, MemoryStorage, Storage
from rollhub.errors import ConfigError


def make_storage(url: str, codec: Codec | None = None) -> Storage:
    """The storage backend ``url`` names.

    Args:
        url: ``memory`` or ``sqlite:///relative/or/absolute/path.db`` (``sqlite:////abs/path.db`` also works),
            optionally with ``?synchronous=full`` to fsync every commit (power-loss durability).
        codec: how the durable backend writes payloads (the memory backend keeps objects and needs none).

    Raises:
        ConfigError: for any other URL, or a ``sqlite://`` URL without a codec.
    """
    if url in ("memory", "memory://", "mem"):
        return MemoryStorage()
    if url.startswith("sqlite://"):
        if codec is None:
            raise ConfigError(
                f"storage {url!r} needs a codec for its payloads; pass one (for scored groups, the server's "
                "rollhub.server.storage.GROUP_CODEC), or use 'memory'",
                field="storage",
            )
        return SqliteStorage.from_url(url, codec)
    raise ConfigError(f"unknown storage URL {url!r}; use 'memory' or 'sqlite:///path/to/rollhub.db'")
