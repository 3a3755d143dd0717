"""The published OpenAPI schema is complete and honest: every ``$ref`` resolves, every 4xx a route gives is
documented, malformed bodies answer 422 on every route, and ``env_id`` is a strict integer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from fastapi.testclient import TestClient

from rollhub.server.factory import create_app
from rollhub.server.settings import ServerSettings
from rollhub.wire import codec
from tests.conftest import registration_body

REGISTRATION = registration_body(4, num_steps=10, checkpoint_dir="")
ENV = {"max_token_length": 64, "desired_name": "env", "weight": 1.0, "group_size": 2}
GROUP = {"tokens": [[1, 2], [3, 4]], "masks": [[1, 2], [3, 4]], "scores": [0.0, 1.0]}
NOT_UTF8 = b'{"env_id": "\xff"}'


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(ServerSettings(storage="memory"))) as c:
        yield c


def registered(client: TestClient) -> int:
    """A registered trainer (which has asked for a batch) and one env; returns the env_id."""
    assert client.post("/register", json=REGISTRATION).status_code == 200
    client.get("/batch")
    answer = client.post("/register-env", json=ENV).json()
    assert answer["status"] == "success", answer
    return int(answer["env_id"])


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _resolve(schema: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"{ref} is not a local reference"
    node: Any = schema
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve (no {part!r})"
        node = node[part]
    return node


def test_every_ref_in_the_published_schema_resolves(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    refs = set(_refs(schema))
    assert "#/components/schemas/ScoredData" in refs
    for ref in refs:
        assert isinstance(_resolve(schema, ref), dict)
    scored = schema["components"]["schemas"]["ScoredData"]
    assert {"tokens", "masks", "scores", "env_id", "policy_version"} <= set(scored["properties"])


def test_data_routes_declare_json_and_msgpack_bodies_and_their_errors(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/scored_data", "/scored_data_list"):
        operation = paths[path]["post"]
        assert set(operation["requestBody"]["content"]) == {"application/json", codec.MEDIA_TYPE}
        assert {"200", "400", "401", "413", "422", "429"} <= set(operation["responses"])
    assert set(paths["/batch"]["get"]["responses"]["200"]["content"]) == {"application/json", codec.MEDIA_TYPE}
    assert {"404", "409", "422"} <= set(paths["/status-env"]["get"]["responses"])
    assert "404" in paths["/ack"]["post"]["responses"] and "403" in paths["/reset_data"]["get"]["responses"]
    for path, item in paths.items():
        for operation in item.values():
            for code, answer in operation["responses"].items():
                if code.startswith("4"):
                    ref = answer["content"]["application/json"]["schema"]["$ref"]
                    assert ref == "#/components/schemas/ErrorAnswer", (path, code)


@pytest.mark.parametrize("path", ["/register", "/register-env", "/disconnect-env", "/ack", "/scored_data"])
def test_a_body_that_is_not_utf8_answers_422_json_invalid_on_every_route(client: TestClient, path: str) -> None:
    answer = client.post(path, content=NOT_UTF8, headers={"Content-Type": "application/json"})
    assert answer.status_code == 422, answer.text
    (entry,) = answer.json()["detail"]
    assert (entry["type"], entry["loc"][0], entry["msg"]) == ("json_invalid", "body", "JSON decode error")


def test_a_body_that_is_not_utf8_answers_422_on_status_env(client: TestClient) -> None:
    registered(client)
    answer = client.request("GET", "/status-env", content=NOT_UTF8, headers={"Content-Type": "application/json"})
    assert answer.status_code == 422 and answer.json()["detail"][0]["type"] == "json_invalid"


@pytest.mark.parametrize("bad", [False, True, "0", 0.0, None])
def test_a_boolean_string_or_float_is_not_an_env_id(client: TestClient, bad: Any) -> None:
    env_id = registered(client)
    assert env_id == 0
    answer = client.post("/disconnect-env", json={"env_id": bad})
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["loc"] == ["body", "env_id"]
    status = client.request("GET", "/status-env", json={"env_id": bad})
    assert status.status_code == 422, status.text
    still = client.get("/status-env", params={"env_id": 0})
    assert still.status_code == 200 and still.json()["env_weight"] == 1.0, "env 0 is still connected"
    for body, headers in (
        (msgpack.packb({**GROUP, "env_id": bad}), {"Content-Type": codec.MEDIA_TYPE}),
        (None, {}),
    ):
        if body is None:
            sent = client.post("/scored_data", json={**GROUP, "env_id": bad})
        else:
            sent = client.post("/scored_data", content=body, headers=headers)
        if bad is None:
            assert sent.status_code == 200, sent.text  # env_id may be left out (null)
        else:
            assert sent.status_code == 422 and "env_id" in sent.json()["detail"][0]["loc"], sent.text
    assert client.get("/status").json()["queue_size"] == (2 if bad is None else 0), "nothing refused was stored"


def test_integer_env_ids_and_counts_as_0_4_0_clients_send_them_still_work(client: TestClient) -> None:
    env_id = registered(client)
    assert client.get("/status-env", params={"env_id": env_id}).status_code == 200
    assert client.request("GET", "/status-env", json={"env_id": env_id}).status_code == 200
    assert client.post("/scored_data", json={**GROUP, "env_id": env_id}).json() == {"status": "received"}
    with_int_weight = client.post("/register-env", json={**ENV, "weight": 1, "min_batch_allocation": 0})
    assert with_int_weight.json()["status"] == "success", "a float field takes a JSON integer"
    assert client.post("/disconnect-env", json={"env_id": env_id}).json() == {"status": "success"}


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/register", "batch_size", True),
        ("/register", "starting_step", "0"),
        ("/register-env", "group_size", True),
        ("/register-env", "weight", False),
    ],
)
def test_registration_numbers_are_strict(client: TestClient, path: str, field: str, value: Any) -> None:
    if path == "/register-env":
        registered(client)
    body = {**(REGISTRATION if path == "/register" else ENV), field: value}
    answer = client.post(path, json=body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["loc"] == ["body", field]


def test_in_process_callers_may_pass_numpy_numbers() -> None:
    """Strictness is about what JSON carries: numpy integers and floats from Python code are numbers."""
    import numpy as np

    from rollhub.wire.models import EnvIdentifier, RegisterEnv

    assert EnvIdentifier(env_id=np.int64(3)).env_id == 3
    env = RegisterEnv(max_token_length=np.int32(8), desired_name="x", weight=np.float32(0.5), group_size=np.int16(2))
    assert (env.max_token_length, env.weight, env.group_size) == (8, 0.5, 2)


def test_every_route_that_needs_the_api_key_documents_its_401() -> None:
    with TestClient(create_app(ServerSettings(storage="memory", api_key="k"))) as keyed:
        schema = keyed.get("/openapi.json").json()
        for path, item in schema["paths"].items():
            for method, operation in item.items():
                answer = keyed.request(method.upper(), path)
                if answer.status_code == 401:
                    assert "401" in operation["responses"], f"{method.upper()} {path} answers 401 undocumented"
                else:
                    assert "401" not in operation["responses"], f"{method.upper()} {path} is open"
        assert keyed.get("/status").status_code == 401
