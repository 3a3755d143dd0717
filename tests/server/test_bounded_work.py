"""Bounded work per request over HTTP: an oversized ``group_size`` is refused at ``/register-env`` (422 naming
the field), so no environment can make combining held groups unbounded."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from rollhub.buffer.envs import MAX_GROUP_SIZE
from rollhub.server import ServerSettings, create_app
from tests.server.test_extensions import REG

ENV = {"max_token_length": 64, "desired_name": "env", "weight": 1.0}


@pytest.mark.parametrize("group_size", [MAX_GROUP_SIZE + 1, 10**9])
def test_register_env_refuses_an_oversized_group_size_with_422(group_size: int) -> None:
    with TestClient(create_app(ServerSettings(storage="memory"))) as c:
        c.post("/register", json=REG)
        c.get("/batch")  # the trainer has started: environments may register
        r = c.post("/register-env", json={**ENV, "group_size": group_size})
        assert r.status_code == 422
        [entry] = r.json()["detail"]
        assert entry["loc"] == ["body", "group_size"] and str(MAX_GROUP_SIZE) in entry["msg"]
        ok = c.post("/register-env", json={**ENV, "group_size": MAX_GROUP_SIZE})
        assert ok.status_code == 200 and ok.json()["env_id"] == 0
