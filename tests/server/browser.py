"""Headless Chromium for the browser tests: one page load with every host but loopback unreachable.

Debian's ``chromium`` (``apt-get install chromium``) is used where it is installed; tests mark themselves with
:data:`needs_chromium` and are skipped elsewhere with that reason.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")


def render_dom(url: str, tmp_path: Path, name: str, *, window: str, budget_ms: int, timeout_s: float = 240,
               screenshot: bool = True) -> str:  # fmt: skip
    """The DOM of ``url`` after ``budget_ms`` of its scripts' (virtual) time, and (unless not ``screenshot``: the
    page is then loaded once only) a screenshot ``name``.png of size ``window`` ("W,H") in ``tmp_path``. Nothing
    but loopback resolves, so a page that needed a CDN renders empty."""
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
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--proxy-server=http://0.0.0.0:9",
        "--proxy-bypass-list=127.0.0.1",
        f"--user-data-dir={tmp_path / f'profile-{name}'}",
        f"--window-size={window}",
        f"--virtual-time-budget={budget_ms}",
    ]
    if screenshot:
        shot = subprocess.run(
            [*base, f"--screenshot={tmp_path / (name + '.png')}", url], capture_output=True, timeout=timeout_s,
            check=False,
        )  # fmt: skip
        assert shot.returncode == 0, shot.stderr.decode(errors="replace")[-2000:]
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, timeout=timeout_s, check=False)
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-2000:]
    return dom.stdout.decode(errors="replace")
