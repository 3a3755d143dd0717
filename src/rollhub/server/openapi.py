"""The published OpenAPI schema: what every route answers, including each 4xx it can give.

The answer models below document the JSON the routes write; the routes build that JSON themselves (byte-compatible
with AtroposLib 0.4.0), so the models are never used to serialize. ``/status`` and ``/status-env`` write the
buffer's own figures (:class:`~rollhub.buffer.BufferStatus`, :class:`~rollhub.buffer.EnvStatus`), so their models
take those dataclasses' fields. ``install`` completes FastAPI's schema with what
it cannot infer: the request models of the routes that read their body by hand (``ScoredData`` as JSON, and the
msgpack form of a group), the answers every route shares (401 when an API key is set; 400, 408, 413 and 422
for routes that read a body), each route's summary and description and the bearer security scheme
(:mod:`rollhub.server.route_docs`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, RootModel, create_model
from pydantic.json_schema import models_json_schema

from rollhub.buffer import BufferStatus, EnvStatus
from rollhub.server import route_docs
from rollhub.server.middleware import DOC_PATHS, OPEN_PATHS
from rollhub.wire import codec
from rollhub.wire.models import EnvIdentifier, ScoredData

_REF = "#/components/schemas/{model}"
_FASTAPI_422 = "#/components/schemas/HTTPValidationError"


class ErrorEntry(BaseModel):
    """One thing wrong with a request: ``loc`` is where (``["body", field, index]`` or ``["query", name]``)."""

    model_config = ConfigDict(extra="allow")

    type: str
    loc: list[str | int]
    msg: str
    input: Any = None
    ctx: dict[str, Any] | None = None


class ErrorAnswer(BaseModel):
    """Every 4xx answer. ``detail`` is a list of entries naming the field at fault and what to do, or a single
    sentence when the request was refused before its body was read (bad gzip, too large, no API key)."""

    detail: list[ErrorEntry] | str


class RootAnswer(BaseModel):
    message: str


class HealthAnswer(BaseModel):
    status: Literal["ok"]
    storage: str
    durable: bool
    step: int


class RegisterAnswer(BaseModel):
    uuid: int


class WandbInfo(BaseModel):
    """The trainer's W&B group and project (null before ``/register``)."""

    group: str | None
    project: str | None


class InfoAnswer(BaseModel):
    """The trainer's batch size (in sequences) and max token length; -1 before ``/register``."""

    batch_size: int
    max_token_len: int


def _figures_answer(name: str, figures: type, doc: str, **described: str) -> type[BaseModel]:
    """The answer model of a route that writes ``asdict`` of the buffer's dataclass ``figures``: its fields, in
    its order, every one required (the route always writes it), ``described`` ones with that description."""
    hints = typing.get_type_hints(figures)
    fields: dict[str, Any] = {
        f.name: (hints[f.name], Field(description=described.get(f.name))) for f in dataclasses.fields(figures)
    }
    return create_model(name, __doc__=doc, __module__=__name__, **fields)


StatusAnswer = _figures_answer(
    "StatusAnswer",
    BufferStatus,
    "0.4.0's ``current_step`` and ``queue_size`` (queued groups), then rollhub's queue figures.",
    policy_version="The latest version the trainer published with POST /policy-version; null before the first.",
)


class EnvWaiting(BaseModel):
    """The trainer has not asked for its first batch yet: register again shortly."""

    status: Literal["wait for trainer to start"]


class EnvRegistered(BaseModel):
    status: Literal["success"]
    env_id: int
    wandb_name: str
    checkpoint_dir: str
    starting_step: int
    checkpoint_interval: int
    num_steps: int


class RegisterEnvAnswer(RootModel[EnvRegistered | EnvWaiting]):
    """``success`` with the env's id and unique W&B run name, or ``wait for trainer to start``."""


class DisconnectAnswer(BaseModel):
    """``success``, or (as in 0.4.0) ``failure`` with ``error`` for an env_id never issued."""

    status: Literal["success", "failure"]
    error: str | None = None


StatusEnvAnswer = _figures_answer(
    "StatusEnvAnswer",
    EnvStatus,
    "0.4.0's arithmetic: ``queue_size`` and ``self_queue_size`` are in units of this env's group size.",
)


class ScoredDataAnswer(BaseModel):
    """``received``, or ``buffered`` with the sequences held until the env's parts make a whole group."""

    status: Literal["received", "buffered"]
    buffer_size: int | None = None


class ScoredDataListAnswer(BaseModel):
    status: Literal["received"]
    groups_processed: int
    buffered: int | None = None
    last_buffer_size: int | None = None


_Rows = list[list[float | None]] | None  # non-finite values a producer sent come back as null


class ServedGroup(BaseModel):
    """A served item: the 14 keys of 0.4.0 in its order, plus ``policy_version`` and ``token_versions`` when the
    producer set them."""

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float | None]
    advantages: _Rows
    ref_logprobs: _Rows
    messages: list[list[dict[str, Any]]] | None
    generation_params: dict[str, Any] | None
    inference_logprobs: _Rows
    overrides: list[dict[str, Any]] | None
    group_overrides: dict[str, Any] | None
    images: Any
    env_id: int | None
    distill_token_ids: list[list[list[int]]] | None
    distill_logprobs: list[list[list[float | None]]] | None
    policy_version: int | None = None
    token_versions: list[list[int]] | None = Field(
        default=None, description="rollhub extension, present when set: per token, the version that sampled it."
    )


class BatchServed(BaseModel):
    """A batch (``batch`` null when none is ready); ``batch_id`` and ``step`` come with ``?lease_s=``."""

    batch: list[ServedGroup] | None
    batch_id: str | None = None
    step: int | None = None


class BatchUnregistered(BaseModel):
    """0.4.0's answer before ``/register``."""

    status: Literal["error"]
    message: str
    batch: list[Any]


class BatchAnswer(RootModel[BatchServed | BatchUnregistered]):
    """A batch, no batch yet, or (before ``/register``) 0.4.0's error object."""


class EmptyExample(BaseModel):
    """``/latest_example`` before anything was queued: 0.4.0's empty lists."""

    tokens: list[Any]
    masks: list[Any]
    scores: list[Any]


class LatestExample(RootModel[ServedGroup | EmptyExample]):
    """The last group queued, or empty lists before any."""


class AckAnswer(BaseModel):
    status: Literal["acknowledged"]


class PolicyVersionAnswer(BaseModel):
    """The published version is now current: the staleness bound compares against it (``max_staleness``), and
    ``stale_dropped`` queued items it made too stale were dropped at once."""

    policy_version: int
    stale_dropped: int


class FleetAnswer(BaseModel):
    """The report is now the fleet's latest: ``/metrics`` and ``/dashboard/data`` show it."""

    status: Literal["received"]
    fleet: str
    workers: int


class PackedRows(BaseModel):
    """A per-token field in msgpack: row lengths and the rows concatenated, as raw little-endian buffers."""

    dtype: str = Field(description="numpy dtype string: |i1 <i2 <i4 <i8 |u1 <u2 <u4 (ints), <f2 <f4 <f8 (floats)")
    lengths: bytes | None = Field(default=None, description="msgpack bin: int32 row lengths (absent for scores)")
    data: bytes = Field(description="msgpack bin: the values, concatenated")


class MsgpackGroup(BaseModel):
    """One group as a msgpack map (``application/msgpack``): the ``ScoredData`` keys, where every per-token
    field may be a :class:`PackedRows` descriptor instead of nested lists (see ``rollhub.wire.codec``)."""

    tokens: PackedRows | list[list[int]]
    masks: PackedRows | list[list[int]]
    scores: PackedRows | list[float]
    advantages: PackedRows | list[list[float]] | None = None
    ref_logprobs: PackedRows | list[list[float]] | None = None
    inference_logprobs: PackedRows | list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any = None
    env_id: int | None = None
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None
    policy_version: int | None = None
    token_versions: PackedRows | list[list[int]] | None = None


class MsgpackBatch(BaseModel):
    """``GET /batch`` with ``Accept: application/msgpack``: the groups in the msgpack form."""

    batch: list[MsgpackGroup] | None
    batch_id: str | None
    step: int | None


#: What each error status means, in general; routes may word their own.
ERRORS: dict[int, str] = {
    400: "The body could not be read: corrupt gzip with Content-Encoding: gzip.",
    401: "This server needs an API key: send Authorization: Bearer KEY, where KEY is the server's --api-key "
    "(servers started with --api-key or ROLLHUB_API_KEY).",
    403: "Switched off on this server.",
    404: "Not known to the server.",
    408: "The body did not arrive in time (--body-idle-timeout between chunks, --body-timeout in all).",
    409: "No trainer is registered, or no connected environment: POST /register (and /register-env) first.",
    413: "The body (after gzip) is over the server's limit (--max-body-mb).",
    422: "Malformed body or parameter (not JSON, not UTF-8, wrong type, missing field, bad shape); detail names "
    "the field and what to do. Nothing was stored.",
    429: "The queue holds --max-queued-sequences; retry after Retry-After seconds. Nothing was stored.",
}


def answers(ok: type[BaseModel] | None = None, errors: dict[int, str] | None = None) -> dict[int | str, Any]:
    """The ``responses`` of a route: its 200 model and its route-specific 4xx (text per status, or the default)."""
    out: dict[int | str, Any] = {}
    if ok is not None:
        out[200] = {"model": ok, "description": ok.__doc__.strip() if ok.__doc__ else "Success"}
    for code, text in (errors or {}).items():
        out[code] = {"model": ErrorAnswer, "description": text or ERRORS[code]}
    return out


#: A valid group, shown as the example body of the data routes (JSON, and msgpack with plain lists).
EXAMPLE_GROUP: dict[str, Any] = {
    "tokens": [[1, 2, 3], [1, 2, 4]],
    "masks": [[-100, 2, 3], [-100, 2, 4]],
    "scores": [1.0, 0.0],
}


def body(
    model: type[BaseModel],
    *,
    many: bool = False,
    required: bool = True,
    packed: type[BaseModel] | None = None,
    example: Any = None,
) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its body by hand: ``model`` as JSON, and as msgpack the
    ``packed`` model (default: :class:`MsgpackGroup`); ``example`` (default: one valid group) for both."""
    json_schema: dict[str, Any] = {"$ref": _REF.format(model=model.__name__)}
    packed_schema: dict[str, Any] = {"$ref": _REF.format(model=(packed or MsgpackGroup).__name__)}
    example = EXAMPLE_GROUP if example is None else example
    if many:
        json_schema = {"type": "array", "items": json_schema}
        packed_schema = {"type": "array", "items": packed_schema}
        example = [example]
    return {
        "requestBody": {
            "required": required,
            "content": {
                "application/json": {"schema": json_schema, "example": example},
                codec.MEDIA_TYPE: {"schema": packed_schema, "example": example},
            },
        }
    }


def batch_answers() -> dict[int | str, Any]:
    """``GET /batch``: JSON, or msgpack when asked with ``Accept: application/msgpack``; 422 for bad parameters."""
    out = answers(BatchAnswer, {422: ""})
    msgpack_schema = {"$ref": _REF.format(model=MsgpackBatch.__name__)}
    out[200]["content"] = {codec.MEDIA_TYPE: {"schema": msgpack_schema}}
    return out


def _error_response(code: int) -> dict[str, Any]:
    schema = {"$ref": _REF.format(model=ErrorAnswer.__name__)}
    return {"description": ERRORS[code], "content": {"application/json": {"schema": schema}}}


def _complete(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the models no route signature names, and the answers every route shares."""
    _, defs = models_json_schema(
        [(m, "validation") for m in (ScoredData, EnvIdentifier, MsgpackGroup, MsgpackBatch, ErrorAnswer)],
        ref_template=_REF,
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in defs.get("$defs", {}).items():
        components.setdefault(name, definition)
    schema["components"]["securitySchemes"] = route_docs.SECURITY_SCHEMES
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            protected = path not in OPEN_PATHS and path not in DOC_PATHS
            route_docs.document(path, method, operation, protected)
            responses = operation.setdefault("responses", {})
            shared = [401] if protected else []
            if "requestBody" in operation:
                shared += [400, 408, 413, 422]
            for code in shared:
                responses.setdefault(str(code), _error_response(code))
            for code, answer in responses.items():
                # Every 4xx is JSON ErrorAnswer: replace FastAPI's own 422 and the text/plain that a route's
                # response_class gives its declared errors.
                if code.startswith("4") and "ErrorAnswer" not in str(answer.get("content", {}).get("application/json")):
                    answer["content"] = _error_response(int(code))["content"]
    if _FASTAPI_422 not in str(schema["paths"]):
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
    return schema


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` (and ``/openapi.json``) return the completed schema."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _complete(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
