"""Client mistakes over HTTP answer 4xx with a message, never 500, and store nothing (both backends).

In-process (TestClient) checks of the rules in ATROPOS-COMPAT.md: bad gzip -> 400, body over the limit
-> 413, unknown env_id -> 422, /status-env for an unknown env, without registration or without a connected
env -> 4xx, shape errors -> 422 naming field and index, full queue -> 429 with Retry-After, unknown lease
-> 404, bad query parameters -> 422.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from rollhub.server import ServerSettings, create_app
from tests.conftest import registration_body

REG = registration_body(4, checkpoint_dir="/ckpt")
ENV = {"max_token_length": 64, "desired_name": "e", "weight": 1.0, "group_size": 2}


def group(tag: int, n: int = 2, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"tokens": [[tag, i] for i in range(n)], "masks": [[-100, i] for i in range(n)]}
    body["scores"] = [1.0] * n
    body.update(fields)
    return body


class Client:
    """A TestClient that fails the test on any 5xx answer."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        answer = self.client.request(method, url, **kwargs)
        assert answer.status_code < 500, (method, url, answer.status_code, answer.text)
        return answer

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def queue_size(self) -> int:
        return self.get("/status").json()["queue_size"]

    def started(self, **env: Any) -> Client:
        """Register the trainer, start it and register one env (group_size 2 unless given)."""
        assert self.post("/register", json=REG).status_code == 200
        self.get("/batch")
        assert self.post("/register-env", json={**ENV, **env}).json()["env_id"] == 0
        return self


@pytest.fixture(params=["memory", "sqlite"])
def make_client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    storage = "memory" if request.param == "memory" else f"sqlite:///{tmp_path / 'rollhub.db'}"
    opened: list[TestClient] = []

    def _make(**settings: Any) -> Client:
        client = TestClient(create_app(ServerSettings(storage=storage, **settings)), raise_server_exceptions=False)
        opened.append(client.__enter__())
        return Client(client)

    yield _make
    for client in opened:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Any) -> Client:
    return make_client()


def detail_locs(answer: httpx.Response) -> list[list[Any]]:
    return [entry["loc"] for entry in answer.json()["detail"]]


# ------------------------------------------------------------------------------------------ status-env


def test_status_env_before_register_is_4xx(client: Client) -> None:
    answer = client.get("/status-env", params={"env_id": 0})
    assert 400 <= answer.status_code < 500 and answer.json()["detail"]
    body = orjson.dumps({"env_id": 0})
    answer = client.get("/status-env", content=body, headers={"Content-Type": "application/json"})
    assert 400 <= answer.status_code < 500


def test_status_env_for_an_unknown_env_is_404(client: Client) -> None:
    client.post("/register", json=REG)
    client.get("/batch")
    assert client.get("/status-env", params={"env_id": 0}).status_code == 404  # no env yet
    client.post("/register-env", json=ENV)
    for env_id in (1, 7, -1):
        assert client.get("/status-env", params={"env_id": env_id}).status_code == 404
        body = orjson.dumps({"env_id": env_id})
        answer = client.get("/status-env", content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 404
    assert client.get("/status-env", params={"env_id": 0}).status_code == 200


def test_status_env_without_a_connected_env_is_4xx(client: Client) -> None:
    client.started()
    client.post("/disconnect-env", json={"env_id": 0})
    answer = client.get("/status-env", params={"env_id": 0})
    assert 400 <= answer.status_code < 500 and answer.json()["detail"]


@pytest.mark.parametrize(
    ("params", "body"),
    [({"env_id": "abc"}, None), ({}, None), ({}, b"not json"), ({}, b'{"env": 0}'), ({}, b'{"env_id": "x"}')],
)
def test_status_env_with_a_bad_env_id_is_422(client: Client, params: dict[str, str], body: bytes | None) -> None:
    client.started()
    headers = {"Content-Type": "application/json"} if body else {}
    assert client.get("/status-env", params=params, content=body, headers=headers).status_code == 422


# ------------------------------------------------------------------------------------------ scored data


def test_unknown_env_id_is_422_and_stores_nothing(client: Client) -> None:
    client.started()
    answer = client.post("/scored_data", json=group(1, env_id=3))
    assert answer.status_code == 422 and ["body", "env_id"] in detail_locs(answer)
    answer = client.post("/scored_data_list", json=[group(1, env_id=0), group(2, env_id=1)])
    assert answer.status_code == 422
    assert client.queue_size() == 0


def test_an_env_id_refused_before_the_trainer_started_says_why_and_what_to_do(client: Client) -> None:
    assert client.post("/register", json=REG).status_code == 200
    waiting = client.post("/register-env", json=ENV)
    assert waiting.status_code == 200 and waiting.content == b'{"status":"wait for trainer to start"}'
    answer = client.post("/scored_data", json=group(1, env_id=0))
    msg = answer.json()["detail"][0]["msg"]
    assert answer.status_code == 422 and msg.startswith("env_id 0 is not registered (0 envs known); ")
    assert "no trainer has called GET /batch yet" in msg and "register again after the trainer starts" in msg
    client.get("/batch")  # the trainer starts; the env never registered again
    msg = client.post("/scored_data", json=group(1, env_id=0)).json()["detail"][0]["msg"]
    assert "answered 'wait for trainer to start' 1 time(s) because no trainer had called GET /batch yet" in msg
    assert "register again now that the trainer has started" in msg
    assert "no trainer" in client.get("/status-env", params={"env_id": 0}).json()["detail"][0]["msg"]
    assert client.post("/register-env", json=ENV).json()["env_id"] == 0
    assert client.post("/scored_data", json=group(1, env_id=0)).status_code == 200
    assert client.queue_size() == 1


def test_policy_version_past_int64_is_422_and_the_next_write_works(client: Client) -> None:
    client.post("/register", json=REG)
    assert client.post("/scored_data", json=group(1, policy_version=2**63)).status_code == 422
    assert client.post("/scored_data", json=group(2, policy_version=2**63 - 1)).status_code == 200
    assert client.post("/scored_data", json=group(3)).status_code == 200
    assert client.queue_size() == 2


def test_group_larger_than_group_size_is_422(client: Client) -> None:
    client.started()
    assert client.post("/scored_data", json=group(1, n=3, env_id=0)).status_code == 422
    assert client.queue_size() == 0 and client.get("/status").json()["held_sequences"] == 0


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"masks": [[-100, 0], [-100]]}, ["body", "masks", 1]),
        ({"scores": [1.0]}, ["body", "scores"]),
        ({"inference_logprobs": [[0.0, -1.0], [0.0]]}, ["body", "inference_logprobs", 1]),
        ({"messages": [[{"role": "user"}], [{"role": "user", "content": "x"}]]}, ["body", "messages"]),
        ({"tokens": [["a", 1], [2, 3]]}, ["body", "tokens", 0, 0]),
    ],
)
def test_invalid_group_is_422_naming_field_and_index(client: Client, fields: dict[str, Any], loc: list[Any]) -> None:
    client.post("/register", json=REG)
    answer = client.post("/scored_data", json=group(1, **fields))
    assert answer.status_code == 422
    assert loc in detail_locs(answer)
    # in a list, the position of the bad group comes first
    answer = client.post("/scored_data_list", json=[group(2), group(1, **fields)])
    assert answer.status_code == 422
    assert [loc[0], 1, *loc[1:]] in detail_locs(answer)
    assert client.queue_size() == 0


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"", b"[1, 2", b'{"tokens": [[1]], "masks": [[1]], "scores": [NaN]}', b"\xff\xfe\x00", b"null"],
)
def test_malformed_json_is_422(client: Client, body: bytes) -> None:
    client.post("/register", json=REG)
    for path in ("/scored_data", "/scored_data_list"):
        answer = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 422, (path, answer.text)
    assert client.queue_size() == 0


def test_bad_gzip_is_400(client: Client) -> None:
    client.post("/register", json=REG)
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    good = gzip.compress(orjson.dumps(group(1)))
    for body in (b"not gzip at all", good[:-8], good[:10]):
        assert client.post("/scored_data", content=body, headers=headers).status_code == 400
    assert client.queue_size() == 0
    assert client.post("/scored_data", content=good, headers=headers).json() == {"status": "received"}
    assert client.queue_size() == 1


def test_body_over_the_limit_is_413_compressed_or_not(make_client: Any) -> None:
    client = make_client(max_body_bytes=4096)
    client.post("/register", json=REG)
    big = orjson.dumps(group(1, n=2, generation_params={"pad": "x" * 8000}))
    assert client.post("/scored_data", content=big, headers={"Content-Type": "application/json"}).status_code == 413
    # a small gzip body that inflates past the limit is refused too
    bomb = gzip.compress(big)
    assert len(bomb) < 4096
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    assert client.post("/scored_data", content=bomb, headers=headers).status_code == 413
    assert client.queue_size() == 0
    assert client.post("/scored_data", json=group(2)).status_code == 200


def test_full_queue_is_429_with_retry_after_and_stores_nothing(make_client: Any) -> None:
    client = make_client(max_queued_sequences=4, retry_after_s=3)
    client.post("/register", json=REG)
    client.post("/scored_data_list", json=[group(1), group(2)])
    answer = client.post("/scored_data_list", json=[group(3), group(4)])
    assert answer.status_code == 429 and answer.headers["Retry-After"] == "3"
    assert client.get("/status").json()["queued_sequences"] == 4
    assert client.get("/batch").json()["batch"] is not None
    assert client.post("/scored_data_list", json=[group(3), group(4)]).status_code == 200


# ------------------------------------------------------------------------------------------ trainer side


def test_batch_before_register_answers_as_0_4_0(client: Client) -> None:
    assert client.get("/batch").json() == {
        "status": "error",
        "message": "Trainer not registered. Call /register first.",
        "batch": [],
    }


@pytest.mark.parametrize("params", [{"lease_s": "0"}, {"lease_s": "-1"}, {"wait_s": "-1"}, {"lease_s": "x"}])
def test_bad_batch_parameters_are_422(client: Client, params: dict[str, str]) -> None:
    client.post("/register", json=REG)
    assert client.get("/batch", params=params).status_code == 422


def test_ack_of_an_unknown_batch_is_404(client: Client) -> None:
    client.post("/register", json=REG)
    assert client.post("/ack", json={"batch_id": "nope"}).status_code == 404
    assert client.post("/ack", json={}).status_code == 422
    client.post("/scored_data_list", json=[group(1), group(2)])
    leased = client.get("/batch", params={"lease_s": 30}).json()
    assert client.post("/ack", json={"batch_id": leased["batch_id"]}).status_code == 200
    assert client.post("/ack", json={"batch_id": leased["batch_id"]}).status_code == 404


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/register", {**REG, "batch_size": 0}),
        ("/register", {**REG, "batch_size": "many"}),
        ("/register", {k: v for k, v in REG.items() if k != "num_steps"}),
        ("/register-env", {**ENV, "group_size": 0}),
        ("/register-env", {**ENV, "min_batch_allocation": 1.5}),
        ("/register-env", {**ENV, "desired_name": None}),
        ("/disconnect-env", {"env": 0}),
    ],
)
def test_bad_registrations_are_422(client: Client, path: str, body: dict[str, Any]) -> None:
    if path != "/register":
        client.post("/register", json=REG)
        client.get("/batch")
    assert client.post(path, json=body).status_code == 422


def test_disconnect_of_an_unknown_env_is_a_failure_answer(client: Client) -> None:
    client.started()
    answer = client.post("/disconnect-env", json={"env_id": 5})
    assert answer.status_code == 200 and answer.json()["status"] == "failure"


def test_reset_answers_text_and_forgets_the_run(client: Client) -> None:
    client.started()
    client.post("/scored_data", json=group(1, env_id=0))
    answer = client.get("/reset_data")
    assert answer.status_code == 200 and answer.text == "Reset successful"
    assert client.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    assert client.queue_size() == 0
    assert 400 <= client.get("/status-env", params={"env_id": 0}).status_code < 500
