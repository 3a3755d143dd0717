"""/docs and /redoc rendered by headless Chromium with every host but loopback unreachable.

Runs where Debian's ``chromium`` is installed (``apt-get install chromium``) and is skipped elsewhere with that
reason. The page is loaded from a real ``rollhub serve``; the rendered DOM is read back with ``--dump-dom``.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ServerProcess
from tests.server.browser import needs_chromium, render_dom

pytestmark = needs_chromium


def render(url: str, tmp_path: Path, name: str) -> str:
    """The DOM of ``url`` after its scripts ran, and a screenshot ``name``.png in ``tmp_path``."""
    return render_dom(url, tmp_path, name, window="1280,900", budget_ms=15000, timeout_s=180)


def test_swagger_ui_and_redoc_render_offline(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    server = server_factory("--storage", "memory", "--api-key", "k").start()
    swagger = render(f"{server.url}/docs", tmp_path, "docs")
    # The operations list is drawn: one block per route, the Atropos routes among them.
    assert swagger.count('class="opblock ') >= 13, swagger[:2000]
    for route in ("/scored_data", "/batch", "/register-env", "/status-env"):
        assert f'data-path="{route}"' in swagger, route
    assert (tmp_path / "docs.png").stat().st_size > 10_000
    redoc = render(f"{server.url}/redoc", tmp_path, "redoc")
    assert "/scored_data_list" in redoc and "AtroposLib API" in redoc
    assert (tmp_path / "redoc.png").stat().st_size > 10_000
