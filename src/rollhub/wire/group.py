"""Exact conversion between one Atropos JSON item and the compact :class:`~rollhub.experience.Group`, both ways.

Per-token lists become :class:`~rollhub.experience.Ragged` numpy buffers (int32 tokens and masks; log-probs
as float32 when that is exact, else float64), never Python lists of ints, and JSON floats exactly
representable in float32 are served back bit-for-bit as the float64 value the client sent
(:func:`group_to_item`). :func:`check_group` is the full check of a group that is to be served.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np
from pydantic import ValidationError

from rollhub.errors import InvalidInput
from rollhub.experience.group import FLOAT_FIELDS, META_FIELDS, VERSION_FIELD, Group, Ragged
from rollhub.wire.admission import check_free_fields
from rollhub.wire.models import SMALL_FIELDS, ScoredData, ScoredDataMeta

_I32 = np.iinfo(np.int32)


class _SlowPath(Exception):
    """The fast converter met something unusual; let pydantic decide (and word the error)."""


def int_array(flat: np.ndarray, name: str) -> np.ndarray:
    """Narrow an integer array to int32 when every value fits, else keep int64."""
    if flat.dtype.kind not in "iu":
        raise InvalidInput(f"{name} must hold integers, got dtype {flat.dtype}", field=name)
    if flat.dtype.itemsize < 4 or (flat.dtype.itemsize == 4 and flat.dtype.kind == "i"):
        return flat.astype(np.int32, copy=False)  # every value fits: no range check needed
    if flat.size and (flat.min() < _I32.min or flat.max() > _I32.max):
        if flat.dtype.kind == "u" and flat.max() > np.iinfo(np.int64).max:
            raise InvalidInput(f"{name} holds a value over int64", field=name)
        return flat.astype(np.int64, copy=False)
    return flat.astype(np.int32, copy=False)


def float_array(flat: np.ndarray, name: str) -> np.ndarray:
    """Store floats as float32 when that is lossless, else float64."""
    if flat.dtype.kind not in "iuf":
        raise InvalidInput(f"{name} must hold numbers, got dtype {flat.dtype}", field=name)
    if flat.dtype == np.float32:
        return flat
    f64 = flat.astype(np.float64, copy=False)
    with np.errstate(over="ignore"):  # values over float32's range stay float64 below
        f32 = f64.astype(np.float32)
    if np.array_equal(f32, f64, equal_nan=True):
        return f32
    return f64


def _ragged_from_lists(rows: Any, name: str, kind: str) -> Ragged:
    if isinstance(rows, Ragged):  # already decoded from a binary body
        conv = int_array if kind == "int" else float_array
        return Ragged(conv(rows.data, name), rows.offsets)
    if type(rows) is not list:
        raise _SlowPath
    lengths = []
    for r in rows:
        if type(r) is not list:
            raise _SlowPath
        lengths.append(len(r))
    total = sum(lengths)
    if total:
        try:
            flat = np.array(list(chain.from_iterable(rows)))
        except (ValueError, TypeError, OverflowError):  # ragged nesting or odd objects: pydantic decides
            raise _SlowPath from None
        if flat.ndim != 1 or flat.size != total or flat.dtype.kind not in ("iu" if kind == "int" else "iuf"):
            raise _SlowPath
    else:
        flat = np.empty(0, dtype=np.int64)
    data = int_array(flat, name) if kind == "int" else float_array(flat, name)
    return Ragged.from_lengths(data, np.asarray(lengths, dtype=np.int64))


def version_rows(arr: Ragged) -> Ragged:
    """``token_versions`` decoded as integers, widened to int64 (how a group holds them)."""
    return Ragged(arr.data.astype(np.int64, copy=False), arr.offsets)


def _scores_from_list(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iuf":
            raise InvalidInput(f"scores must be a 1-D array of numbers, got {value.dtype}", field="scores")
        return value.astype(np.float64, copy=False)
    if type(value) is not list:
        raise _SlowPath
    try:
        arr = np.array(value, dtype=None) if value else np.empty(0, dtype=np.float64)
    except (ValueError, TypeError, OverflowError):
        raise _SlowPath from None
    if arr.ndim != 1 or arr.dtype.kind not in "iuf":
        raise _SlowPath
    return arr.astype(np.float64, copy=False)


def group_from_json(obj: Any, *, check_advantage_lengths: bool = True) -> Group:
    """Build and validate a :class:`Group` from a decoded JSON (or msgpack list-form) ``ScoredData`` object.

    Raises:
        pydantic.ValidationError: for type errors, worded exactly as FastAPI would.
        InvalidInput: for shape errors (field and index named).
    """
    if not isinstance(obj, dict):
        ScoredData.model_validate(obj)  # raises the model-type error
    try:
        group = _fast_group(obj)
    except _SlowPath:
        group = _group_from_model(ScoredData.model_validate(obj))
    check_group(group, check_advantage_lengths=check_advantage_lengths)
    return group


def check_group(group: Group, *, check_advantage_lengths: bool = True) -> None:
    """Check ``group``'s shapes and values (:meth:`Group.validate`) and that every answer, JSON and msgpack, can
    carry its free-form fields (:mod:`rollhub.wire.admission`).

    Args:
        group: the group to check.
        check_advantage_lengths: require advantage rows as long as their token rows (see :meth:`Group.validate`).

    Raises:
        InvalidInput: naming the field (and index or path inside it) that is wrong.
    """
    group.validate(check_advantage_lengths=check_advantage_lengths)
    check_free_fields(group.meta)  # only what every answer (JSON and msgpack) can carry is accepted


def json_rows(arr: Ragged) -> list[np.ndarray]:
    """``arr``'s rows ready for orjson: float32 widened to float64 so the exact value the client sent comes back."""
    if arr.data.dtype == np.float32:
        return Ragged(arr.data.astype(np.float64), arr.offsets).rows()
    return arr.rows()


def _json_rows(arr: Ragged | None) -> list[np.ndarray] | None:
    return None if arr is None else json_rows(arr)


def group_to_item(group: Group) -> dict[str, Any]:
    """The served item of ``group``: the 14 keys of 0.4.0 in its order (plus the extensions ``policy_version``
    and ``token_versions`` when set, which Atropos clients ignore), its arrays as numpy rows for orjson
    (``OPT_SERIALIZE_NUMPY``)."""
    meta = group.meta
    item: dict[str, Any] = {
        "tokens": group.tokens.rows(),
        "masks": group.masks.rows(),
        "scores": group.scores,
        "advantages": _json_rows(group.advantages),
        "ref_logprobs": _json_rows(group.ref_logprobs),
        "messages": meta.get("messages"),
        "generation_params": meta.get("generation_params"),
        "inference_logprobs": _json_rows(group.inference_logprobs),
        "overrides": meta.get("overrides"),
        "group_overrides": meta.get("group_overrides"),
        "images": meta.get("images"),
        "env_id": group.env_id,
        "distill_token_ids": meta.get("distill_token_ids"),
        "distill_logprobs": meta.get("distill_logprobs"),
    }
    if group.policy_version is not None:
        item["policy_version"] = group.policy_version
    if group.token_versions is not None:
        item[VERSION_FIELD] = group.token_versions.rows()
    return item


def _fast_group(obj: dict[str, Any]) -> Group:
    for required in ("tokens", "masks", "scores"):
        if required not in obj:
            raise _SlowPath
    group = Group(
        tokens=_ragged_from_lists(obj["tokens"], "tokens", "int"),
        masks=_ragged_from_lists(obj["masks"], "masks", "int"),
        scores=_scores_from_list(obj["scores"]),
    )
    for name in FLOAT_FIELDS:
        value = obj.get(name)
        if value is not None:
            setattr(group, name, _ragged_from_lists(value, name, "float"))
    if (versions := obj.get(VERSION_FIELD)) is not None:
        if not (isinstance(versions, Ragged) and versions.data.dtype == np.int64):  # int64 bodies stay views
            versions = version_rows(_ragged_from_lists(versions, VERSION_FIELD, "int"))
        group.token_versions = versions
    meta_in = {k: obj[k] for k in SMALL_FIELDS if k in obj}
    if all(obj.get(k) is None for k in META_FIELDS) and all(
        type(obj.get(k)) in (int, type(None)) for k in ("env_id", "policy_version")
    ):  # nothing for pydantic to check (the common case of a binary body)
        group.env_id, group.policy_version = obj.get("env_id"), obj.get("policy_version")
        return group
    try:
        meta = ScoredDataMeta.model_validate(meta_in)
    except ValidationError:
        raise _SlowPath from None
    apply_meta(group, meta)
    return group


def apply_meta(group: Group, meta: ScoredDataMeta | ScoredData) -> None:
    """Copy the validated small fields onto ``group``: the set ones of ``META_FIELDS`` into ``group.meta``,
    ``env_id`` and ``policy_version`` onto the group."""
    for name in META_FIELDS:
        value = getattr(meta, name)
        if value is not None:
            group.meta[name] = value
    group.env_id = meta.env_id
    group.policy_version = meta.policy_version


def _group_from_model(model: ScoredData) -> Group:
    def ragged(rows: list[list[Any]] | None, name: str, kind: str) -> Ragged | None:
        if rows is None:
            return None
        try:
            arrays = [np.asarray(r, dtype=np.int64 if kind == "int" else np.float64) for r in rows]
        except OverflowError:
            raise InvalidInput(f"{name} holds an integer that does not fit in int64", field=name) from None
        conv = int_array if kind == "int" else float_array
        lengths = np.asarray([len(a) for a in arrays], dtype=np.int64)
        flat = np.concatenate(arrays) if arrays else np.empty(0, np.int64)
        return Ragged.from_lengths(conv(flat, name), lengths)

    group = Group(
        tokens=ragged(model.tokens, "tokens", "int"),  # type: ignore[arg-type]
        masks=ragged(model.masks, "masks", "int"),  # type: ignore[arg-type]
        scores=np.asarray(model.scores, dtype=np.float64),
    )
    for name in FLOAT_FIELDS:
        setattr(group, name, ragged(getattr(model, name), name, "float"))
    if (versions := ragged(model.token_versions, VERSION_FIELD, "int")) is not None:
        group.token_versions = version_rows(versions)
    apply_meta(group, model)
    return group
