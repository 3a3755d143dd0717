"""Freed heap memory is handed back after large JSON requests, once it passes the limit (glibc)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from rollhub.server import ServerSettings, create_app
from rollhub.server.heap import HeapTrimmer
from tests.server.test_extensions import REG, group

trimmer = HeapTrimmer()
needs_glibc = pytest.mark.skipif(not trimmer.active, reason="heap trimming needs glibc 2.33 or later")


@needs_glibc
def test_trims_only_past_the_limit() -> None:
    held = [bytearray(100_000) for _ in range(200)]  # heap chunks, then freed: glibc keeps them
    del held
    assert HeapTrimmer(limit_bytes=2**62)() is False
    over = HeapTrimmer(limit_bytes=0)
    assert over.free_bytes() > 0
    assert over() is True and over.trims == 1


@needs_glibc
def test_json_ingest_trims_the_heap() -> None:
    app = create_app(ServerSettings(storage="memory"))
    app.state.trim_heap.limit_bytes = 0
    with TestClient(app) as c:
        c.post("/register", json=REG)
        assert c.post("/scored_data", json=group(1)).status_code == 200
        assert c.post("/scored_data_list", json=[group(2)]).status_code == 200
    assert app.state.trim_heap.trims == 2


def test_elsewhere_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.platform", "darwin")
    idle = HeapTrimmer(limit_bytes=0)
    assert not idle.active and idle() is False and idle.free_bytes() == 0
