"""Storage for the replay-buffer actor: fragments as compact bytes, so the SQLite backend can hold them.

The buffer's SQLite storage writes payloads with the codec it is given; a :class:`SampleFragment` is a handful of
numpy arrays and a few labels. :func:`encode_fragment` writes them as one JSON header (field names, dtypes, shapes,
labels) followed by the raw array bytes (:data:`FRAGMENT_CODEC`): no pickle, so a damaged or foreign file can only
fail to decode, never run code.
:func:`make_fragment_storage` is the one factory the replay buffer uses: ``memory`` keeps fragments as objects,
``sqlite:///path.db`` stores them durably (a restarted buffer actor reloads every fragment it acknowledged).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from rollhub.buffer import Codec, Storage, make_storage
from rollhub.experience import SampleFragment

_MAGIC = b"RHF1"
_ARRAYS = (
    "obs",
    "actions",
    "rewards",
    "terminated",
    "truncated",
    "logp",
    "values",
    "final_values",
    "bootstrap_obs",
    "versions",
    "episode_ids",
    "state_in",
)


def encode_fragment(fragment: SampleFragment) -> bytes:
    """The fragment as bytes: magic, header length, JSON header, then each array's C-ordered bytes.

    Raises:
        TypeError: ``fragment`` is not a SampleFragment, or one of its arrays holds Python objects.
    """
    if not isinstance(fragment, SampleFragment):
        raise TypeError(f"expected a SampleFragment, got {type(fragment).__name__}")
    arrays: list[tuple[str, np.ndarray]] = []
    for name in _ARRAYS:
        value = getattr(fragment, name)
        if value is None:
            continue
        array = np.ascontiguousarray(value)
        if array.dtype.hasobject:
            raise TypeError(f"fragment field {name!r} holds Python objects ({array.dtype}); use numeric arrays")
        arrays.append((name, array))
    header = {
        "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in arrays],
        "bootstrap_value": float(fragment.bootstrap_value),
        "worker_id": fragment.worker_id,
        "env_index": int(fragment.env_index),
        "task": fragment.task,
        "created_at": float(fragment.created_at),
    }
    head = json.dumps(header).encode()
    return b"".join([_MAGIC, struct.pack("<I", len(head)), head, *(a.tobytes() for _, a in arrays)])


def decode_fragment(blob: bytes | memoryview) -> SampleFragment:
    """The fragment :func:`encode_fragment` wrote (arrays are fresh, writable copies).

    Raises:
        ValueError: the bytes are not an encoded fragment (wrong magic, truncated, or inconsistent).
    """
    data = bytes(blob)
    if data[:4] != _MAGIC or len(data) < 8:
        raise ValueError("not an encoded SampleFragment (bad magic or too short)")
    (head_len,) = struct.unpack_from("<I", data, 4)
    header = json.loads(data[8 : 8 + head_len])
    offset = 8 + head_len
    fields: dict[str, Any] = {"state_in": None}
    for name, dtype_str, shape in header["arrays"]:
        if name not in _ARRAYS:
            raise ValueError(f"unknown fragment field {name!r}")
        dtype = np.dtype(dtype_str)
        if dtype.hasobject:
            raise ValueError(f"fragment field {name!r} has an object dtype")
        count = int(np.prod(shape, dtype=np.int64))
        end = offset + count * dtype.itemsize
        if end > len(data):
            raise ValueError(f"fragment field {name!r} is truncated ({len(data) - offset} of {end - offset} bytes)")
        fields[name] = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape).copy()
        offset = end
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} trailing bytes after the fragment's arrays")
    labels = ("bootstrap_value", "worker_id", "env_index", "task", "created_at")
    return SampleFragment(**fields, **{key: header[key] for key in labels})


FRAGMENT_CODEC = Codec(encode_fragment, decode_fragment, holds="SampleFragments")
"""Fragments as :func:`encode_fragment` writes them (what the replay buffer's SQLite storage keeps)."""


def make_fragment_storage(url: str) -> Storage:
    """Storage for fragments: ``memory`` (objects in a dict) or ``sqlite:///path.db`` (durable, see
    :class:`rollhub.buffer.sqlite.SqliteStorage`; ``?synchronous=full`` for power-loss durability).

    Raises:
        ConfigError: for any other URL.
    """
    return make_storage(url, FRAGMENT_CODEC)
