"""The published AtroposLib 0.4.0 HTTP test modules, run unchanged against ``rollhub serve``.

The modules ship in the ``atroposlib`` wheel and start the server with ``python -m atroposlib.cli.run_api
--host localhost --port 8000``. Here they run in a child pytest whose import path puts a two-file shim package
first: its ``atroposlib.cli.run_api`` starts rollhub (on the embedded sqlite default) instead. The port is moved
to a free one so the suite never clashes with anything else on 8000; nothing else in the modules is changed.

Two tests of test_api_messages_handling post advantage rows longer than their token rows (4 values for 3
tokens), which rollhub rejects by default; the server here runs with that one check off
(``ROLLHUB_CHECK_ADVANTAGE_LENGTHS=false``, the same as ``--no-check-advantage-lengths``).
test_strict_server_rejects_what_the_published_tests_send shows the default.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

MODULES = ("test_api_legacy.py", "test_api_compression.py", "test_api_messages_handling.py")
SHIM_RUN_API = """
import sys
from rollhub.cli import serve
raise SystemExit(serve(sys.argv[1:], prog="run-api"))
"""


def _published_tests() -> Path:
    spec = importlib.util.find_spec("atroposlib")
    if spec is None or spec.origin is None:
        pytest.skip("atroposlib 0.4.0 is not installed (make setup installs it into .venv/reference)")
    return Path(spec.origin).parent / "tests"


@pytest.mark.parametrize("module", MODULES)
def test_published_module_passes_against_rollhub(module: str, tmp_path: Path) -> None:
    source = _published_tests()
    port = free_port()
    shim = tmp_path / "shim" / "atroposlib"
    (shim / "cli").mkdir(parents=True)
    (shim / "tests").mkdir()
    (shim / "__init__.py").write_text("")
    (shim / "cli" / "__init__.py").write_text("")
    (shim / "cli" / "run_api.py").write_text(SHIM_RUN_API)
    (shim / "tests" / "__init__.py").write_text("")
    for name in ("api_test_utils.py", module):
        text = (source / name).read_text()
        text = text.replace("localhost:8000", f"localhost:{port}").replace('"8000"', f'"{port}"')
        (shim / "tests" / name).write_text(text)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "shim"), os.environ.get("PYTHONPATH", "")]),
        "ROLLHUB_STORAGE": f"sqlite:///{tmp_path / 'rollhub.db'}",
        "ROLLHUB_CHECK_ADVANTAGE_LENGTHS": "false",
    }
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(shim / "tests" / module)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, summary
    assert "skipped" not in summary and "failed" not in summary, summary


def test_strict_server_rejects_what_the_published_tests_send() -> None:
    """The default server names the field and index of an advantages row longer than its token row."""
    from fastapi.testclient import TestClient

    from rollhub.server import ServerSettings, create_app

    body = {"tokens": [[920, 921, 922]], "masks": [[1, 1, 1]], "scores": [0.6], "advantages": [[0.5, 0.3, 0.2, 0.1]]}
    with TestClient(create_app(ServerSettings(storage="memory"))) as client:
        answer = client.post("/scored_data", json=body)
        assert answer.status_code == 422
        assert answer.json()["detail"][0]["loc"] == ["body", "advantages", 0]
        assert client.get("/status").json()["queue_size"] == 0
    with TestClient(create_app(ServerSettings(storage="memory", check_advantage_lengths=False))) as client:
        assert client.post("/scored_data", json=body).status_code == 200
