"""/dashboard: the page loads without a key (it holds no data), its data needs the key, environments by name."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from rollhub.server import ServerSettings, create_app
from rollhub.server.dashboard import DATA_PATH
from tests.conftest import ServerProcess, registration_body

KEY = "s3cret"
REG = registration_body(64)


def group(n: int, env_id: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "tokens": [[1, i, 9] for i in range(n)],
        "masks": [[-100, i, 9] for i in range(n)],
        "scores": [1.0] * n,
    }
    if env_id is not None:
        body["env_id"] = env_id
    return body


def env(name: str, group_size: int = 4) -> dict[str, Any]:
    return {"max_token_length": 64, "desired_name": name, "weight": 1.0, "group_size": group_size}


def test_page_loads_without_a_key_and_its_data_needs_one() -> None:
    with TestClient(create_app(ServerSettings(storage="memory", api_key=KEY))) as c:
        page = c.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<input id="key"' in page.text
        for path in (DATA_PATH, "/status", "/metrics", "/status-env?env_id=0"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        answer = c.get(DATA_PATH, headers={"Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 200 and answer.json()["envs"] == []


def test_page_script_sends_the_key_as_bearer_and_asks_for_it_on_401() -> None:
    with TestClient(create_app(ServerSettings(storage="memory", api_key=KEY))) as c:
        page = c.get("/dashboard").text
    assert f'const DATA = "{DATA_PATH}";' in page  # the route the script polls is the one served
    assert "fetch(DATA, {headers: headers" in page
    assert '{"Authorization": "Bearer " + key}' in page
    assert "localStorage.setItem(STORE, keyBox.value)" in page and "localStorage.getItem(STORE)" in page
    assert "r.status === 401" in page and "This server needs an API key" in page
    assert "innerHTML" not in page  # environment names come from clients: the page only sets textContent


def test_data_names_every_environment_and_counts_its_sequences() -> None:
    with TestClient(create_app(ServerSettings(storage="memory"))) as c:
        assert c.post("/register", json=REG).status_code == 200
        c.get("/batch")
        ids = [c.post("/register-env", json=env(name)).json()["env_id"] for name in ("gsm8k", "gsm8k", "math")]
        assert ids == [0, 1, 2]
        assert c.post("/disconnect-env", json={"env_id": 2}).status_code == 200
        for body in (group(4, 0), group(4, 0), group(4, 1), group(2, 1), group(3)):
            assert c.post("/scored_data", json=body).status_code == 200
        data = c.get(DATA_PATH).json()
        assert data["status"] == c.get("/status").json()
    rows = {(row["name"], row["wandb_name"]): row for row in data["envs"]}
    assert list(rows) == [("gsm8k", "gsm8k_0"), ("gsm8k", "gsm8k_1"), ("math", "math_0"), ("(no env)", None)]
    assert rows[("gsm8k", "gsm8k_0")]["queued_sequences"] == 8
    assert rows[("gsm8k", "gsm8k_1")]["queued_sequences"] == 4
    assert rows[("gsm8k", "gsm8k_1")]["held_sequences"] == 2  # a part group waits for the rest of its 4
    assert rows[("math", "math_0")]["connected"] is False and rows[("math", "math_0")]["queued_sequences"] == 0
    assert rows[("(no env)", None)]["queued_sequences"] == 3
    assert all(row["stale_dropped"] == 0 for row in rows.values())


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the page's script")
def test_page_script_against_a_server_with_a_key(server_factory: type[ServerProcess], tmp_path: Path) -> None:
    """The served page's own script, run in Node: it asks for the key, sends it as Bearer, shows envs by name."""
    server = server_factory("--storage", "memory", "--api-key", KEY).start()
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, timeout=30, headers=auth) as c:
        assert c.post("/register", json=REG).status_code == 200
        c.get("/batch")
        assert c.post("/register-env", json=env("gsm8k")).json()["env_id"] == 0
        assert c.post("/scored_data", json=group(4, 0)).status_code == 200
    page = httpx.get(server.url + "/dashboard", timeout=30)
    assert page.status_code == 200
    (tmp_path / "dashboard.html").write_text(page.text)
    harness = Path(__file__).with_name("dashboard_page.js")
    run = subprocess.run(
        ["node", str(harness), str(tmp_path / "dashboard.html"), server.url, KEY],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    steps = {s["step"]: s for s in map(json.loads, run.stdout.splitlines())}
    no_key, wrong, right, reloaded = (steps[k] for k in ("no key", "wrong key", "right key", "reloaded"))
    assert no_key["last_request"] == {"path": DATA_PATH, "headers": {}}
    assert "needs an API key" in no_key["message"] and no_key["envs"] == []
    assert wrong["last_request"]["headers"] == {"Authorization": f"Bearer wrong-{KEY}"}
    assert "refused this API key" in wrong["message"]
    assert right["last_request"]["headers"] == auth and right["message"] == ""
    assert ["queue_size", "1"] in right["status"]
    assert right["envs"][0][0] == "name" and right["envs"][1][:2] == ["gsm8k", "0"]
    assert right["envs"][1][5] == "4"  # queued sequences
    assert reloaded["stored"] == KEY and reloaded["last_request"]["headers"] == auth
    assert reloaded["envs"] == right["envs"]
