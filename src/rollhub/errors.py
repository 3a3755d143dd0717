"""The one error hierarchy of rollhub.

Every error a caller can cause is a :class:`RollhubError` subclass whose message names the offending value
and says what to do. The HTTP server maps them to status codes in one place (the table in ``rollhub.server.errors``), so
the core never imports a web framework and errors that never reach HTTP carry no status.
"""

from __future__ import annotations

from typing import Any


class RollhubError(Exception):
    """Base class of every error rollhub raises on purpose.

    Attributes:
        field: the request field at fault, when there is one.
        index: the position inside that field (sequence index), when there is one.
    """

    def __init__(self, message: str, *, field: str | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.index = index

    def detail(self) -> list[dict[str, Any]]:
        """The error as FastAPI-style ``detail`` entries, so clients parse one format."""
        loc: list[Any] = ["body"]
        if self.field is not None:
            loc.append(self.field)
        if self.index is not None:
            loc.append(self.index)
        return [{"type": self.kind, "loc": loc, "msg": self.message}]

    @property
    def kind(self) -> str:
        return type(self).__name__


class InvalidInput(RollhubError):
    """A request whose shape or values break the wire contract (answered 422). Nothing was stored."""


class PayloadTooLarge(RollhubError):
    """A request body over the configured size limit (answered 413)."""


class NotRegistered(RollhubError):
    """An operation that needs ``POST /register`` first (answered 409)."""


class UnknownEnv(RollhubError):
    """An env_id the server never issued (answered 404)."""


class UnknownBatch(RollhubError):
    """A batch id that is not leased (never issued, already acknowledged, or expired) (answered 404)."""


class QueueFull(RollhubError):
    """The queue holds its configured maximum; retry after ``retry_after_s`` (answered 429).

    Nothing of the refused request was stored. A writer that sends a write in several requests sets ``accepted``:
    how many of the write's first items earlier requests stored (resend the rest; 0: nothing was stored).
    """

    def __init__(self, message: str, *, retry_after_s: float, accepted: int = 0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.accepted = accepted


class Forbidden(RollhubError):
    """A route switched off by configuration (answered 403)."""


class Unauthorized(RollhubError):
    """A missing or wrong API key (answered 401)."""


class StorageError(RollhubError):
    """The storage backend failed or holds data it cannot read (answered 503)."""


class StorageFull(StorageError):
    """The disk under the storage is full: new data is refused (answered 503 with ``Retry-After``).

    Nothing of the refused request was stored; serving and acknowledging go on, and consumed data frees space.
    """

    def __init__(self, message: str, *, retry_after_s: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ItemsDamaged(StorageError):
    """Stored items failed their checksum or cannot be decoded; storage has quarantined them (answered 503).

    Attributes:
        gids: the storage keys of the damaged items; they will never be served.
    """

    def __init__(self, message: str, *, gids: list[int]) -> None:
        super().__init__(message)
        self.gids = gids


class ConfigError(RollhubError):
    """A configuration value that cannot work, such as an unknown storage URL."""


class VersionConflict(RollhubError):
    """A value that would move a counter backwards, such as a lower published policy version (answered 409)."""


class StopRequested(RollhubError):
    """A stop signal (Ctrl-C, SIGTERM) cut a wait short before anything ran, e.g. an inference engine's start;
    what was started for the wait has been stopped."""
