"""The request sequences of Atropos's BaseEnv and its example trainer, replayed against atroposlib 0.4.0 and
against rollhub: the same answers, step by step, except rollhub's documented fixes (tested at the end)."""

from __future__ import annotations

import gzip
import importlib.util
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from rollhub.run.child_server import atropos_server
from tests.conftest import ServerProcess

REGISTRATION = {
    "wandb_group": "grp",
    "wandb_project": "proj",
    "batch_size": 8,
    "max_token_len": 256,
    "checkpoint_dir": "/tmp/ckpt",
    "save_checkpoint_interval": 5,
    "starting_step": 0,
    "num_steps": 50,
}


def _group(seed: int, n: int, env_id: int | None) -> dict[str, Any]:
    tokens = [[seed * 10 + i, 7, seed + i + 1] for i in range(n)]
    return {
        "tokens": tokens,
        "masks": [[-100, 7, t[2]] for t in tokens],
        "scores": [float((seed + i) % 3) - 0.5 for i in range(n)],
        "inference_logprobs": [[1.0, -0.25, -0.125 * (i + 1)] for i in range(n)],
        "messages": [
            [{"role": "user", "content": f"q{seed}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(n)
        ],
        "overrides": [{}] * n,
        "group_overrides": {"seed": seed},
        "env_id": env_id,
    }


def _post_gzip(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    data = gzip.compress(orjson.dumps(body))
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    return client.post(path, content=data, headers=headers)


def _status_env(client: httpx.Client, env_id: int) -> httpx.Response:
    # BaseEnv sends the env id as a JSON body on a GET.
    return client.request(
        "GET", "/status-env", content=orjson.dumps({"env_id": env_id}), headers={"Content-Type": "application/json"}
    )


def _scenario(client: httpx.Client) -> list[tuple[str, int, Any]]:
    """The BaseEnv and example-trainer request sequence; one (label, status, json) per request."""
    out: list[tuple[str, int, Any]] = []

    def record(label: str, response: httpx.Response) -> None:
        out.append((label, response.status_code, response.json()))

    env_a = {"max_token_length": 256, "desired_name": "gsm", "weight": 1.0, "group_size": 4}
    env_b = {
        "max_token_length": 128,
        "desired_name": "gsm",
        "weight": 2.0,
        "group_size": 4,
        "min_batch_allocation": 0.25,
    }
    record("wandb_info before register", client.get("/wandb_info"))
    record("info before register", client.get("/info"))
    record("status before register", client.get("/status"))
    record("batch before register", client.get("/batch"))
    record("register-env before trainer", client.post("/register-env", json=env_a))
    record("register", client.post("/register", json=REGISTRATION))
    record("info", client.get("/info"))
    record("wandb_info", client.get("/wandb_info"))
    record("register-env before first batch", client.post("/register-env", json=env_a))
    record("first batch (starts the trainer)", client.get("/batch"))
    record("register-env a", client.post("/register-env", json=env_a))
    record("status-env a alone", _status_env(client, 0))
    for seed in range(3):
        record(f"scored_data a {seed}", _post_gzip(client, "/scored_data", _group(seed, 4, 0)))
        record(f"status-env a after {seed}", _status_env(client, 0))
    record("status", client.get("/status"))
    record("latest_example", client.get("/latest_example"))
    record("batch 1", client.get("/batch"))
    record("status after batch 1", client.get("/status"))
    record("batch none", client.get("/batch"))
    record("register-env b (same name)", client.post("/register-env", json=env_b))
    record("status-env a with b", _status_env(client, 0))
    record("status-env b", _status_env(client, 1))
    record("scored_data_list", _post_gzip(client, "/scored_data_list", [_group(10, 4, 1), _group(11, 4, 0)]))
    record("status-env b after list", _status_env(client, 1))
    record("batch with minimums", client.get("/batch"))
    record("disconnect b", client.post("/disconnect-env", json={"env_id": 1}))
    record("disconnect unknown", client.post("/disconnect-env", json={"env_id": 9}))
    record("status-env a after disconnect", _status_env(client, 0))
    record("scored_data a last", _post_gzip(client, "/scored_data", _group(20, 4, 0)))
    record("batch after disconnect", client.get("/batch"))
    record("status end", client.get("/status"))
    return out


def _normalize(label: str, body: Any) -> Any:
    if label == "register":
        assert isinstance(body["uuid"], int)
        return {"uuid": "<int>"}
    if label.startswith("status") and isinstance(body, dict) and "queue_size" in body and "current_step" in body:
        # rollhub adds its own queue figures to /status; the 0.4.0 keys must be equal.
        keys = ("current_step", "queue_size", "unallocated_fraction", "self_queue_size", "max_group_size", "env_weight")
        return {k: body[k] for k in keys if k in body}
    if label == "disconnect unknown":
        return {"status": body["status"], "has_error": bool(body.get("error"))}
    return body


@pytest.fixture(scope="module")
def reference_url() -> Iterator[str]:
    if importlib.util.find_spec("atroposlib") is None:
        pytest.skip("atroposlib 0.4.0 is not installed (make test installs it)")
    server = atropos_server().start()
    try:
        yield server.url
    finally:
        server.stop()


def test_same_answers_as_atroposlib(reference_url: str, server_factory: type[ServerProcess], sqlite_url: str) -> None:
    rollhub = server_factory("--storage", sqlite_url).start()
    with (
        httpx.Client(base_url=reference_url, timeout=10) as ref,
        httpx.Client(base_url=rollhub.url, timeout=10) as ours,
    ):
        expected = _scenario(ref)
        got = _scenario(ours)
    assert [label for label, _, _ in got] == [label for label, _, _ in expected]
    for (label, ref_status, ref_body), (_, status, body) in zip(expected, got, strict=True):
        assert status == ref_status, label
        assert _normalize(label, body) == _normalize(label, ref_body), label


def test_documented_fixes(reference_url: str, server_factory: type[ServerProcess]) -> None:
    """Where rollhub answers differently on purpose (docs/atropos.md: differences from Atropos 0.4.0)."""
    rollhub = server_factory("--storage", "memory").start()
    env = {"max_token_length": 64, "desired_name": "mix", "weight": 1.0, "group_size": 4}
    with httpx.Client(base_url=rollhub.url, timeout=10) as c:
        c.post("/register", json={**REGISTRATION, "batch_size": 4})
        c.get("/batch")
        c.post("/register-env", json=env)
        # Mixed sizes: 2 + 2 are merged into ONE group of 4 (0.4.0 queues two groups it can never batch).
        assert c.post("/scored_data", json=_group(1, 2, 0)).json() == {"status": "buffered", "buffer_size": 2}
        assert c.post("/scored_data", json=_group(2, 2, 0)).json() == {"status": "buffered", "buffer_size": 0}
        assert c.get("/status").json()["queue_size"] == 1
        batch = c.get("/batch").json()["batch"]
        assert len(batch) == 1 and len(batch[0]["tokens"]) == 4
        # Shapes 0.4.0 accepts silently are refused, naming field and index, and nothing is stored.
        bad = _group(3, 4, 0)
        bad["masks"][2] = bad["masks"][2][:-1]
        answer = c.post("/scored_data", json=bad)
        assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "masks", 2]
        assert c.get("/status").json()["queue_size"] == 0
        # Unknown env ids and status-env mistakes are 4xx, never 500; ?env_id= works as well as the body.
        assert c.post("/scored_data", json=_group(4, 4, 7)).status_code == 422
        assert c.get("/status-env", params={"env_id": 9}).status_code == 404
        assert c.get("/status-env", params={"env_id": 0}).json()["queue_size"] == 0
        # Oldest batch first, one step per served batch.
        for seed in (5, 6):
            c.post("/scored_data", json=_group(seed, 4, 0))
        first = c.get("/batch").json()["batch"]
        assert first[0]["group_overrides"] == {"seed": 5}
        assert c.get("/status").json()["current_step"] == 2
        # Reset clears everything, max_token_len and latest_example included.
        assert c.get("/reset_data").text == "Reset successful"
        assert c.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
        assert c.get("/latest_example").json()["tokens"] == []
    with httpx.Client(base_url=reference_url, timeout=10) as ref:
        # 0.4.0 for contrast: scored data before /register wedges it (later registers never initialise).
        ref.get("/reset_data")
        ref.post("/scored_data", json=_group(1, 4, None))
        ref.post("/register", json=REGISTRATION)
        assert ref.get("/info").json()["batch_size"] == -1
    with httpx.Client(base_url=rollhub.url, timeout=10) as c:
        c.post("/scored_data", json=_group(1, 4, None))
        c.post("/register", json=REGISTRATION)
        assert c.get("/info").json()["batch_size"] == 8
