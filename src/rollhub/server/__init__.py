"""The HTTP server: ``create_app(settings)``; ``rollhub.server:app`` builds one from ``ROLLHUB_*`` variables."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollhub.server.settings import ServerSettings

if TYPE_CHECKING:
    from rollhub.server.factory import create_app

__all__ = ["ServerSettings", "create_app"]

_app: Any = None


def __getattr__(name: str) -> Any:
    # The app's modules (FastAPI, the routes: about 0.6 s) load on first use, not when a command that only
    # needs the settings imports this package; `uvicorn rollhub.server:app` builds the app on first access.
    global _app
    if name not in ("create_app", "app"):
        raise AttributeError(name)  # e.g. a submodule not imported yet: the import system loads it
    from rollhub.server.factory import create_app

    if name == "create_app":
        return create_app
    if _app is None:
        _app = create_app(ServerSettings.from_env())
    return _app
