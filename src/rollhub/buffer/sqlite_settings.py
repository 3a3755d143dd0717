"""The settings of :class:`rollhub.buffer.sqlite.SqliteStorage`: its URL and the values it refuses."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from rollhub.errors import ConfigError


def sqlite_url(url: str) -> tuple[str, str]:
    """``sqlite:///rel.db`` or ``sqlite:////abs.db`` (``?synchronous=full`` optional) -> (path, synchronous)."""
    parts = urlsplit(url)
    path = parts.path
    if path.startswith("/") and not path.startswith("//"):
        path = path[1:]  # sqlite:///rel.db -> rel.db ; sqlite:////abs.db -> /abs.db
    elif path.startswith("//"):
        path = path[1:]
    if parts.netloc:
        path = parts.netloc + ("/" + path if path else "")
    if not path:
        raise ConfigError(f"storage URL {url!r} names no file; use sqlite:///rollhub.db")
    query = parse_qs(parts.query)
    return path, query.get("synchronous", ["NORMAL"])[0]


def checked_settings(synchronous: str, checkpoint_bytes: int, blob_bytes: int | None, segment_bytes: int,
                     reserve_bytes: int, idle_s: float) -> str:  # fmt: skip
    """Refuse settings that cannot work, naming the field; return the SQLite ``synchronous`` level."""
    if checkpoint_bytes < 1:
        raise ConfigError(f"checkpoint_bytes must be positive, got {checkpoint_bytes}", field="checkpoint_bytes")
    if (blob_bytes is not None and blob_bytes < 1) or segment_bytes < 1:
        raise ConfigError(
            f"blob_bytes and segment_bytes must be positive, got {blob_bytes}, {segment_bytes}", field="blob_bytes"
        )
    if reserve_bytes < 0 or not idle_s > 0:
        raise ConfigError(f"reserve_bytes must be >= 0 and idle_s > 0, got {reserve_bytes}, {idle_s}", field="idle_s")
    sync = synchronous.upper()
    if sync not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        raise ConfigError(f"synchronous={synchronous!r}; use normal or full", field="synchronous")
    return sync
