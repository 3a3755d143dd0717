"""/docs and /redoc rendered by headless Chromium with every host but loopback unreachable.

Runs where Debian's ``chromium`` is installed (``apt-get install chromium``) and is skipped elsewhere with that
reason. The page is loaded from a real ``rollhub serve``; the rendered DOM is read back with ``--dump-dom``.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from rollhub.server import route_docs
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


def _text(dom: str) -> str:
    """The page's text without tags or white space (markup splits a sentence where code spans start), entities
    decoded."""
    return "".join(html.unescape(re.sub(r"<[^>]+>", " ", dom)).split())


def _plain(markdown: str) -> str:
    return "".join(markdown.replace("`", "").split())


def test_docs_show_the_authorize_button_and_every_route_described(
    server_factory: type[ServerProcess], tmp_path: Path
) -> None:
    server = server_factory("--storage", "memory", "--api-key", "k").start()
    swagger = render(f"{server.url}/docs", tmp_path, "docs")
    assert 'class="btn authorize' in swagger and "Authorize" in _text(swagger), swagger[:3000]
    shown = _text(swagger)
    for summary, _ in route_docs.ROUTES.values():
        assert _plain(summary) in shown, summary  # the operations list shows each route's summary
    redoc = _text(render(f"{server.url}/redoc", tmp_path, "redoc"))
    for _, description in route_docs.ROUTES.values():  # ReDoc shows every description in full
        assert _plain(description) in redoc, description
    assert _plain("Bearer KEY, where KEY is the server's --api-key") in redoc
