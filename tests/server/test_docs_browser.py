"""/docs and /redoc rendered by headless Chromium with every host but loopback unreachable.

Runs where Debian's ``chromium`` is installed (``apt-get install chromium``) and is skipped elsewhere with that
reason. The page is loaded from a real ``rollhub serve``; the rendered DOM is read back with ``--dump-dom``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ServerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")


def render(url: str, tmp_path: Path, name: str) -> str:
    """The DOM of ``url`` after its scripts ran, and a screenshot ``name``.png in ``tmp_path``."""
    profile = tmp_path / f"profile-{name}"
    base = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        # Nothing but loopback resolves: a page that needed a CDN would render empty.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--proxy-server=http://0.0.0.0:9",
        "--proxy-bypass-list=127.0.0.1",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
        "--virtual-time-budget=15000",
    ]
    shot = subprocess.run(
        [*base, f"--screenshot={tmp_path / (name + '.png')}", url], capture_output=True, timeout=180, check=False
    )
    assert shot.returncode == 0, shot.stderr.decode(errors="replace")[-2000:]
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, timeout=180, check=False)
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-2000:]
    return dom.stdout.decode(errors="replace")


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
