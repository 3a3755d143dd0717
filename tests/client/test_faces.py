"""One client implementation: the blocking classes are faces of the async ones, and a batch decodes to the same
``Group`` objects whichever transport it came over."""

from __future__ import annotations

import asyncio
import inspect

import httpx
import numpy as np
import orjson
import pytest

from rollhub.client import AsyncEnvClient, AsyncTrainerClient, EnvClient, TrainerClient
from rollhub.client._blocking import drive
from rollhub.client.trainer import parse_batch
from rollhub.errors import InvalidInput
from rollhub.experience import Group
from rollhub.wire import codec
from rollhub.wire.group import group_to_item

ITEM = {
    "tokens": [[5, 6, 7], [5, 8]],
    "masks": [[-100, 6, 7], [-100, 8]],
    "scores": [1.0, -0.5],
    "advantages": [[0.0, 0.1, 0.2], [0.3, 0.4]],
    "inference_logprobs": [[1.0, -0.5, -0.1], [1.0, -0.75]],
    "messages": [[{"role": "user", "content": "2+2"}], [{"role": "user", "content": "2+3"}]],
    "env_id": 3,
    "policy_version": 7,
}


def _public(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_") and callable(getattr(cls, name))}


@pytest.mark.parametrize(("face", "core"), [(TrainerClient, AsyncTrainerClient), (EnvClient, AsyncEnvClient)])
def test_every_async_method_has_its_blocking_face_with_the_same_signature(face: type, core: type) -> None:
    assert _public(core) <= _public(face) | {"aclose"}
    for name in _public(core) - {"aclose"}:
        assert inspect.signature(getattr(face, name)) == inspect.signature(getattr(core, name)), name
        assert getattr(face, name).__doc__ == getattr(core, name).__doc__, name


def test_drive_refuses_a_coroutine_that_awaits_asyncio_io() -> None:
    async def suspends() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="blocking=True"):
        drive(suspends())


def _json_answer(body: dict) -> httpx.Response:
    return httpx.Response(200, content=orjson.dumps(body), headers={"content-type": "application/json"})


def _msgpack_answer(body: dict) -> httpx.Response:
    return httpx.Response(200, content=codec.packb(body), headers={"content-type": codec.MEDIA_TYPE})


def test_json_and_msgpack_batches_decode_to_equal_groups() -> None:
    group = codec.group_from_map(dict(ITEM))
    from_json = parse_batch(_json_answer({"batch": [ITEM], "batch_id": "b1", "step": 4}))
    from_msgpack = parse_batch(_msgpack_answer({"batch": [codec.group_to_map(group)], "batch_id": "b1", "step": 4}))
    assert from_json is not None and from_msgpack is not None
    for batch in (from_json, from_msgpack):
        assert (batch.batch_id, batch.step, len(batch), batch.sequences) == ("b1", 4, 1, 2)
        served = batch[0]
        assert type(served) is Group
        assert [row.tolist() for row in served.tokens.rows()] == ITEM["tokens"]
        assert served.scores.tolist() == ITEM["scores"]
        assert served.advantages is not None and np.allclose(served.advantages.row(1), [0.3, 0.4])
        assert served.meta["messages"] == ITEM["messages"]
        assert (served.env_id, served.policy_version) == (3, 7)
    assert group_to_item(from_json[0]).keys() == group_to_item(from_msgpack[0]).keys()
    assert orjson.dumps(group_to_item(from_json[0]), option=orjson.OPT_SERIALIZE_NUMPY) == orjson.dumps(
        group_to_item(from_msgpack[0]), option=orjson.OPT_SERIALIZE_NUMPY
    )


def test_no_batch_is_none_and_advantage_lengths_a_server_allowed_are_kept() -> None:
    assert parse_batch(_json_answer({"batch": None})) is None
    assert parse_batch(_msgpack_answer({"batch": []})) is None
    odd = {**ITEM, "advantages": [[0.5], [0.25]]}  # one per sequence: a server may be set to allow it
    batch = parse_batch(_json_answer({"batch": [odd]}))
    assert batch is not None and batch[0].advantages is not None and batch[0].advantages.lengths.tolist() == [1, 1]


@pytest.mark.parametrize("answer", [_json_answer, _msgpack_answer])
def test_a_malformed_served_group_is_an_error_naming_the_group_and_field(answer) -> None:
    bad = {**ITEM, "masks": [[-100, 6, 7], [-100]]}  # second mask shorter than its tokens
    with pytest.raises(InvalidInput, match="masks") as info:
        parse_batch(answer({"batch": [ITEM, bad]}))
    assert info.value.field == "masks"
    assert "served group 1" in " ".join(getattr(info.value, "__notes__", [])) + str(info.value)
