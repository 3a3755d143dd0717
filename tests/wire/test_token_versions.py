"""Per-token versions (``token_versions``): built from completions, carried by both wires, sqlite and the server."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient

from rollhub.buffer.sqlite import SqliteStorage
from rollhub.envs.group.scored import make_group, stamp
from rollhub.errors import InvalidInput
from rollhub.experience import Group, Ragged
from rollhub.inference.base import Completion
from rollhub.server import ServerSettings, create_app
from rollhub.server.storage import GROUP_CODEC
from rollhub.wire import codec
from rollhub.wire.group import group_from_json, group_to_item
from rollhub.wire.ingest import BodyInvalid, decode_groups

N = 2
REGISTRATION = {
    "wandb_group": "g", "wandb_project": "p", "batch_size": 2 * N, "max_token_len": 2048, "checkpoint_dir": "/tmp/c",
    "save_checkpoint_interval": 10, "starting_step": 0, "num_steps": 10,
}  # fmt: skip
ENV = {"max_token_length": 2048, "desired_name": "versions", "weight": 1.0, "group_size": N}


def completion(prompt: tuple[int, ...], tokens: tuple[int, ...], versions: tuple[int, ...] | None) -> Completion:
    logprobs = tuple(-0.25 * (i + 1) for i in range(len(tokens)))
    return Completion(prompt, tokens, logprobs, "x", "stop", None, versions)


def versioned_group(seed: int = 0) -> Group:
    """Two sequences of 3 prompt tokens; the second continued across a push from version 3 to 4."""
    comps = [completion((1, 2, 3), (10 + seed, 11, 12, 13), (3, 3, 4, 4)),
             completion((1, 2, 3), (20 + seed, 21), (4, 4))]  # fmt: skip
    return make_group("env", f"ex{seed}", comps, [1.0, 0.0], [True, False])


def plain_group(seed: int = 0) -> Group:
    comps = [completion((1, 2), (30 + seed, 31), None), completion((1, 2), (40 + seed,), None)]
    return make_group("env", f"plain{seed}", comps, [0.5, 0.0], [False, False])


def assert_versions(got: Group, sent: Group) -> None:
    if sent.token_versions is None:
        assert got.token_versions is None
        return
    assert got.token_versions is not None and got.token_versions.data.dtype == np.int64
    np.testing.assert_array_equal(got.token_versions.offsets, sent.token_versions.offsets)
    np.testing.assert_array_equal(got.token_versions.data, sent.token_versions.data)
    assert got.policy_version == sent.policy_version


def test_make_group_sets_token_versions_and_the_oldest_version() -> None:
    group = versioned_group()
    assert group.token_versions is not None
    assert [r.tolist() for r in group.token_versions.rows()] == [[-1, -1, -1, 3, 3, 4, 4], [-1, -1, -1, 4, 4]]
    assert group.policy_version == 3 and group.oldest_token_version() == 3
    # the manager's stamp keeps the oldest token's version, not the version loaded when the group was stamped
    assert stamp(group, 7, "w", 0.0).policy_version == 3
    group.validate()


def test_make_group_without_versions_leaves_them_out() -> None:
    group = plain_group()
    assert group.token_versions is None and group.policy_version is None
    assert stamp(group, 7, "w", 0.0).policy_version == 7
    # one completion without versions is enough to leave them out
    mixed = [completion((1,), (5, 6), (2, 2)), completion((1,), (7,), None)]
    assert make_group("env", "m", mixed, [0.0, 1.0], [False, True]).token_versions is None


@pytest.mark.parametrize("make", [versioned_group, plain_group])
def test_json_and_msgpack_round_trips(make: Any) -> None:
    sent = make()
    item = group_to_item(sent)
    assert ("token_versions" in item) == (sent.token_versions is not None)
    body = orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY)
    assert_versions(group_from_json(orjson.loads(body)), sent)
    assert_versions(decode_groups(body, "application/json", many=False)[0], sent)  # the simdjson path
    packed = codec.pack_group(sent)
    assert_versions(codec.unpack_group(packed), sent)
    assert_versions(codec.unpack_stored_group(packed), sent)
    got = decode_groups(memoryview(bytearray(packed)), codec.MEDIA_TYPE, many=False)[0]  # the zero-copy reader
    assert_versions(got, sent)
    if sent.token_versions is not None:
        bare = Group(sent.tokens, sent.masks, sent.scores, token_versions=sent.token_versions)
        got = decode_groups(memoryview(bytearray(codec.pack_group(bare))), codec.MEDIA_TYPE, many=False)[0]
        assert got.wire is not None  # a group with an int64 descriptor and no free fields is stored as it arrived
        assert codec.map_to_arrays(msgpack.unpackb(packed))["token_versions"][0].tolist() == [-1, -1, -1, 3, 3, 4, 4]


def test_merged_and_compacted_groups_keep_them() -> None:
    a, b = versioned_group(0), versioned_group(1)
    merged = Group.merge([a, b])
    assert merged.token_versions is not None and merged.token_versions.n_rows == 4
    assert Group.merge([a, plain_group()]).token_versions is None
    compact = a.compacted(min_bytes=0)
    assert_versions(compact, a)


@pytest.mark.parametrize(
    ("versions", "message"),
    [
        ([[-1, -1, -1, 3, 3, 4], [-1, -1, -1, 4, 4]], "token_versions[0] has 6 values but tokens[0] has 7"),
        ([[-1, -1, -1, 3, 3, 4, 4], [-1, -2, -1, 4, 4]], "token_versions[1] contains -2"),
        ([[-1, -1, -1, 3, 3, 4, 4]], "token_versions has 1 rows but tokens has 2"),
    ],
)
def test_bad_token_versions_are_refused_naming_the_field(versions: list[list[int]], message: str) -> None:
    item = group_to_item(versioned_group()) | {"token_versions": versions}
    with pytest.raises(InvalidInput, match=re.escape(message)) as err:
        group_from_json(orjson.loads(orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY)))
    assert err.value.field == "token_versions"
    body = orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY)
    with pytest.raises(BodyInvalid) as bad:
        decode_groups(body, "application/json", many=False)
    assert bad.value.entries[0]["loc"][:2] == ["body", "token_versions"]
    group = versioned_group()
    group.token_versions = Ragged.from_rows([np.asarray(r, np.int64) for r in versions], np.int64)
    with pytest.raises(BodyInvalid, match="token_versions"):
        decode_groups(codec.pack_group(group), codec.MEDIA_TYPE, many=False)


def test_a_float_version_is_refused_by_the_model() -> None:
    item = group_to_item(versioned_group()) | {"token_versions": [[-1, -1, -1, 3.5, 3, 4, 4], [-1, -1, -1, 4, 4]]}
    with pytest.raises(BodyInvalid) as bad:
        decode_groups(orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY), "application/json", many=False)
    assert bad.value.entries[0]["loc"][:2] == ["body", "token_versions"]


def test_the_server_stores_and_serves_them_json_and_msgpack(tmp_path: Path) -> None:
    sent = [versioned_group(0), plain_group(0), versioned_group(1), plain_group(1)]
    with TestClient(create_app(ServerSettings(storage=f"sqlite:///{tmp_path}/a.db"))) as c:
        c.post("/register", json=REGISTRATION)
        assert c.get("/batch").json() == {"batch": None}
        env_id = c.post("/register-env", json=ENV).json()["env_id"]
        for g in sent:
            g.env_id = env_id
        json_body = orjson.dumps([group_to_item(g) for g in sent[:2]], option=orjson.OPT_SERIALIZE_NUMPY)
        answer = c.post("/scored_data_list", content=json_body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 200, answer.text
        msgpack_body = codec.packb([codec.group_to_map(g) for g in sent[2:]])
        answer = c.post("/scored_data_list", content=msgpack_body, headers={"Content-Type": codec.MEDIA_TYPE})
        assert answer.status_code == 200, answer.text
        served = c.get("/batch", params={"lease_s": 60}).json()["batch"]
        assert [("token_versions" in item) for item in served] == [True, False]
        for item, g in zip(served, sent[:2], strict=True):
            assert_versions(group_from_json(item), g)
        served = c.get("/batch", params={"lease_s": 60}, headers={"Accept": codec.MEDIA_TYPE})
        for item, g in zip(msgpack.unpackb(served.content)["batch"], sent[2:], strict=True):
            assert_versions(codec.group_from_map(item), g)
    storage = SqliteStorage(tmp_path / "a.db", codec=GROUP_CODEC)
    try:
        stored = storage.payloads([item.entry.gid for item in storage.load().items])
        assert len(stored) == 4
        for got, g in zip(stored, sent, strict=True):
            assert_versions(got, g)
    finally:
        storage.close()


def test_atroposlib_0_4_0_accepts_and_ignores_them() -> None:
    """A producer sending the extension to the published server is answered as without it."""
    if importlib.util.find_spec("atroposlib") is None:
        pytest.skip("atroposlib 0.4.0 is not installed (make test installs it)")
    from rollhub.run.child_server import atropos_server

    server = atropos_server().start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            c.post("/register", json=REGISTRATION)
            c.post("/register-env", json=ENV)
            items = [group_to_item(versioned_group(i)) | {"env_id": 0} for i in range(2)]
            body = orjson.dumps(items, option=orjson.OPT_SERIALIZE_NUMPY)
            answer = c.post("/scored_data_list", content=body, headers={"Content-Type": "application/json"})
            assert answer.status_code == 200, answer.text
            served = c.get("/batch", params={"lease_s": 60}).json()["batch"]
            assert len(served) == 2 and all("token_versions" not in item for item in served)
            assert served[0]["tokens"] == [r.tolist() for r in versioned_group(0).tokens.rows()]
    finally:
        server.stop()
