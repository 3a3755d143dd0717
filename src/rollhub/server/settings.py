"""Configuration of the buffer server (a config type: built by the CLI or from ``ROLLHUB_*`` variables)."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

DEFAULT_STORAGE = "sqlite:///rollhub.db"


class ServerSettings(BaseModel):
    """Everything ``create_app`` needs.

    Attributes:
        storage: storage URL (``memory`` or ``sqlite:///path.db``).
        max_body_bytes: largest request body accepted, after gzip decompression (413 past it).
        max_staleness: serve nothing older than ``current_step - max_staleness`` (None: off).
        max_queued_sequences: bound on waiting sequences; past it producers get 429 (None: unbounded).
        retry_after_s: the Retry-After suggested with a 429.
        api_key: when set, every route but ``GET /`` and ``/health`` needs ``Authorization: Bearer <key>``.
        allow_reset: whether ``GET /reset_data`` may wipe the server.
        gzip_level: compression level of gzip responses (1 is fast and still shrinks JSON several-fold).
        max_wait_s: cap on ``GET /batch?wait_s=``.
        check_advantage_lengths: reject advantage rows of another length than their token rows (422).
        max_request_memory_bytes: most memory all request bodies in flight may hold at once; past it a body
            is refused with 503 and ``Retry-After`` (memory is reserved as bytes arrive, not when declared).
        body_idle_timeout_s: a body whose sender sends nothing for this long is answered 408.
        body_timeout_s: a body not complete this long after its read began is answered 408.
        stamp_unversioned: a group that arrives without ``policy_version`` gets the trainer's latest published
            version (``current_step`` before any publish); see :class:`rollhub.buffer.BufferConfig`.
    """

    storage: str = DEFAULT_STORAGE
    max_body_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    max_staleness: int | None = Field(default=None, ge=0)
    max_queued_sequences: int | None = Field(default=None, gt=0)
    retry_after_s: float = Field(default=1.0, gt=0)
    api_key: str | None = None
    allow_reset: bool = True
    gzip_level: int = Field(default=1, ge=1, le=9)
    max_wait_s: float = Field(default=300.0, gt=0)
    check_advantage_lengths: bool = True
    max_request_memory_bytes: int = Field(default=512 * 1024 * 1024, gt=0)
    body_idle_timeout_s: float = Field(default=30.0, gt=0)
    body_timeout_s: float = Field(default=300.0, gt=0)
    stamp_unversioned: bool = False

    @classmethod
    def from_env(cls, **overrides: object) -> ServerSettings:
        """Settings from ``ROLLHUB_STORAGE``, ``ROLLHUB_API_KEY``, ``ROLLHUB_MAX_STALENESS``, ... then overrides."""
        values: dict[str, object] = {}
        for name in cls.model_fields:
            raw = os.environ.get(f"ROLLHUB_{name.upper()}")
            if raw is not None and raw != "":
                values[name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)
