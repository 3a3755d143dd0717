"""The HTTP server: ``create_app(settings)``; ``rollhub.server:app`` builds one from ``ROLLHUB_*`` variables."""

from __future__ import annotations

from typing import Any

from rollhub.server.factory import create_app
from rollhub.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]

_app: Any = None


def __getattr__(name: str) -> Any:
    # `uvicorn rollhub.server:app` (and --reload) builds the app on first access, not at import.
    global _app
    if name == "app":
        if _app is None:
            _app = create_app(ServerSettings.from_env())
        return _app
    raise AttributeError(name)
