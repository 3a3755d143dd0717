"""The LLM group: one scored group of sequences as numpy arrays, the unit every layer passes whole.

A :class:`Group` keeps per-token arrays as :class:`Ragged` numpy buffers (int32 tokens and masks; log-probs
as float32 when that is exact, else float64), never as Python lists of ints. JSON floats that are exactly
representable in float32 are stored as float32 and served back bit-for-bit as the float64 value the client
sent, so the JSON round trip is exact while memory stays near 12 bytes a token.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollhub.errors import InvalidInput

PROMPT_MASK = -100
"""The ``masks`` value on a prompt position of a token row (a completion position holds its token id)."""
PROMPT_LOGPROB = 1.0
"""The ``inference_logprobs`` value on a prompt position of a token row (a completion position holds the
behaviour log-prob)."""
NOT_SAMPLED = -1
"""The ``token_versions`` value on a position the policy did not sample (prompt, environment or template tokens)."""

INT_FIELDS = ("tokens", "masks")
VERSION_FIELD = "token_versions"
"""The optional per-token integer field: the policy version that sampled each token (int64)."""
FLOAT_FIELDS = ("advantages", "ref_logprobs", "inference_logprobs")
META_FIELDS = (
    "messages",
    "generation_params",
    "overrides",
    "group_overrides",
    "images",
    "distill_token_ids",
    "distill_logprobs",
)


@dataclass(slots=True)
class Ragged:
    """Rows of different lengths stored as one flat array plus ``offsets`` (``len == rows + 1``)."""

    data: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_rows(cls, rows: list[np.ndarray], dtype: Any) -> Ragged:
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        if rows:
            np.cumsum([len(r) for r in rows], out=offsets[1:])
            data = np.concatenate(rows).astype(dtype, copy=False) if offsets[-1] else np.empty(0, dtype)
        else:
            data = np.empty(0, dtype)
        return cls(data, offsets)

    @classmethod
    def from_lengths(cls, data: np.ndarray, lengths: np.ndarray) -> Ragged:
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(data, offsets)

    @property
    def n_rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row(self, i: int) -> np.ndarray:
        return self.data[self.offsets[i] : self.offsets[i + 1]]

    def rows(self) -> list[np.ndarray]:
        o = self.offsets.tolist()
        d = self.data
        return [d[o[i] : o[i + 1]] for i in range(len(o) - 1)]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.offsets.nbytes)

    @staticmethod
    def concat(parts: list[Ragged]) -> Ragged:
        rows = [r for p in parts for r in p.rows()]
        dtype = np.result_type(*[p.data.dtype for p in parts])
        return Ragged.from_rows(rows, dtype)


@dataclass(slots=True)
class Group:
    """One scored group of ``size`` sequences (the unit the buffer queues, packs and serves whole).

    Attributes:
        tokens, masks: per-sequence token ids (prompt then completion) and training masks (:data:`PROMPT_MASK` on
            prompt positions, the token id on completion ones).
        scores: one finite float64 score per sequence.
        advantages, ref_logprobs, inference_logprobs: optional per-token floats; a Ragged with zero rows
            stands for an explicit ``[]`` and round-trips as ``[]``.
        token_versions: optional per-token int64 rows aligned with ``tokens``: the policy version of the weights
            that sampled each completion token (a generation continued across a weight push holds two or more),
            :data:`NOT_SAMPLED` (-1) on prompt and environment positions. Zero rows stands for ``[]``.
        meta: the small optional fields (messages, generation_params, ...) exactly as the client gave them.
        env_id: the registered environment that produced it, or None.
        policy_version: the trainer step of the weights that produced it, or None (never stale). A producer that
            sets ``token_versions`` sets it to the oldest sampled token's version
            (:meth:`oldest_token_version`), so every staleness rule, which reads ``policy_version``, measures
            the oldest token.
        wire: the msgpack encoding the group was decoded from, when it decodes back to exactly this group
            (set by the binary ingest path; lets storage write it without encoding the group again).
    """

    tokens: Ragged
    masks: Ragged
    scores: np.ndarray
    advantages: Ragged | None = None
    ref_logprobs: Ragged | None = None
    inference_logprobs: Ragged | None = None
    token_versions: Ragged | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    env_id: int | None = None
    policy_version: int | None = None
    wire: memoryview | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> tuple[Any, ...]:
        # ``wire`` is a view of this process's memory: a copy sent elsewhere is encoded again where needed
        return tuple(None if name == "wire" else getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(self.__slots__, state, strict=True):
            object.__setattr__(self, name, value)

    @property
    def size(self) -> int:
        """Number of sequences."""
        return self.tokens.n_rows

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.offsets[-1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (the per-token cost of buffering this group)."""
        total = self.tokens.nbytes + self.masks.nbytes + self.scores.nbytes
        for name in FLOAT_FIELDS:
            arr = getattr(self, name)
            if arr is not None:
                total += arr.nbytes
        if self.token_versions is not None:
            total += self.token_versions.nbytes
        return total

    def oldest_token_version(self) -> int | None:
        """The oldest version that sampled any token (the smallest ``token_versions`` value that is not
        :data:`NOT_SAMPLED`), or None without ``token_versions`` or without a sampled position."""
        if self.token_versions is None:
            return None
        sampled = self.token_versions.data[self.token_versions.data != NOT_SAMPLED]
        return int(sampled.min()) if sampled.size else None

    def validate(self, *, check_advantage_lengths: bool = True) -> None:
        """Check the shapes 0.4.0 accepts silently and that every value is finite; raise :class:`InvalidInput`
        naming field and index. Whether every answer can carry the free-form fields is the wire's check
        (:func:`rollhub.wire.group.check_group` runs both).

        Args:
            check_advantage_lengths: require advantage rows as long as their token rows. Off only for
                clients known to send advantages of other lengths (some of 0.4.0's own tests do).
        """
        n = self.size
        if n == 0:
            raise InvalidInput("tokens must hold at least one sequence", field="tokens")
        lengths = self.tokens.lengths
        _check_rows("masks", self.masks, lengths, allow_empty=False)
        if len(self.scores) != n:
            raise InvalidInput(
                f"scores has {len(self.scores)} values but tokens has {n} sequences; send one score per sequence",
                field="scores",
            )
        bad = np.flatnonzero(~np.isfinite(self.scores))
        if bad.size:
            i = int(bad[0])
            raise InvalidInput(f"scores[{i}] is {self.scores[i]}; scores must be finite", field="scores", index=i)
        self._validate_float_rows(lengths, check_advantage_lengths)
        if self.token_versions is not None:
            self._validate_versions(lengths)
        for name in ("messages", "overrides", "distill_token_ids", "distill_logprobs"):
            value = self.meta.get(name)
            if value and len(value) != n:
                raise InvalidInput(
                    f"{name} has {len(value)} entries but tokens has {n} sequences; send one per sequence or []",
                    field=name,
                )
        if self.policy_version is not None and not 0 <= self.policy_version < 2**63:
            raise InvalidInput(
                f"policy_version is {self.policy_version}; it must be between 0 and 2**63 - 1",
                field="policy_version",
            )

    def _validate_float_rows(self, lengths: np.ndarray, check_advantage_lengths: bool) -> None:
        """Per-token float fields: one row per sequence (or none), as long as their token rows, all finite."""
        n = len(lengths)
        for name in FLOAT_FIELDS:
            arr = getattr(self, name)
            if arr is not None:
                if name != "advantages" or check_advantage_lengths:
                    _check_rows(name, arr, lengths, allow_empty=True)
                elif arr.n_rows not in (0, n):
                    raise InvalidInput(f"advantages has {arr.n_rows} rows but tokens has {n} sequences", field=name)
                # inf cannot be served as JSON (it would come back as null), so it is refused like NaN
                finite = np.isfinite(arr.data)
                if finite.all():
                    continue
                bad = np.flatnonzero(~finite)
                if bad.size:
                    row = int(np.searchsorted(arr.offsets, int(bad[0]), "right")) - 1
                    raise InvalidInput(
                        f"{name}[{row}] contains {arr.data[bad[0]]}; values must be finite",
                        field=name,
                        index=row,
                    )

    def _validate_versions(self, lengths: np.ndarray) -> None:
        """``token_versions``: int64 rows as long as their token rows (or none), every value -1 or above."""
        arr = self.token_versions
        assert arr is not None
        if arr.data.dtype != np.int64:
            raise InvalidInput(
                f"token_versions must hold int64 values, got dtype {arr.data.dtype}", field=VERSION_FIELD
            )
        _check_rows(VERSION_FIELD, arr, lengths, allow_empty=True)
        bad = np.flatnonzero(arr.data < NOT_SAMPLED)
        if bad.size:
            row = int(np.searchsorted(arr.offsets, int(bad[0]), "right")) - 1
            raise InvalidInput(
                f"token_versions[{row}] contains {int(arr.data[bad[0]])}; a token's version is a policy version "
                f"(0 or above), or {NOT_SAMPLED} on a position the policy did not sample",
                field=VERSION_FIELD,
                index=row,
            )

    def compacted(self, min_bytes: int = 64 * 1024) -> Group:
        """The same group with all its arrays copied into one anonymous memory mapping of their own.

        A buffer holds groups for a long time while requests allocate and free large transient buffers; if both
        come from the same heap, freed gaps between long-lived arrays keep resident memory well above the data
        held. One mapping per group is returned to the system whole when the group is dropped. Groups smaller
        than ``min_bytes``, and groups whose large arrays already share one mapping no more than twice their size
        (a binary body read into a mapping of its own), are returned unchanged.
        """
        fields = [("tokens", self.tokens), ("masks", self.masks)]
        fields += [(name, getattr(self, name)) for name in FLOAT_FIELDS if getattr(self, name) is not None]
        if self.token_versions is not None:
            fields.append((VERSION_FIELD, self.token_versions))
        arrays = [self.scores] + [a for _, r in fields for a in (r.data, r.offsets)]
        sizes = [(a.nbytes + 7) // 8 * 8 for a in arrays]
        if sum(sizes) < min_bytes or _in_own_mapping(arrays, sum(sizes), min_bytes):
            return self
        region = mmap.mmap(-1, sum(sizes))
        copies, offset = [], 0
        for a, size in zip(arrays, sizes, strict=True):
            view = np.frombuffer(region, dtype=a.dtype, count=a.size, offset=offset)
            view[:] = a
            copies.append(view)
            offset += size
        out = Group(
            tokens=self.tokens,
            masks=self.masks,
            scores=copies[0],
            meta=self.meta,
            env_id=self.env_id,
            policy_version=self.policy_version,
        )
        for k, (name, _) in enumerate(fields):
            setattr(out, name, Ragged(copies[1 + 2 * k], copies[2 + 2 * k]))
        return out

    @staticmethod
    def merge(parts: list[Group]) -> Group:
        """Concatenate held groups of one env into one group (the mixed-size combining rule).

        A per-token field or per-sequence meta field present in every part is concatenated; one missing
        from some part cannot describe every sequence and is dropped. The merged group carries the oldest
        policy_version of its parts, so staleness is judged conservatively.
        """
        first = parts[0]
        merged = Group(
            tokens=Ragged.concat([p.tokens for p in parts]),
            masks=Ragged.concat([p.masks for p in parts]),
            scores=np.concatenate([p.scores for p in parts]),
            env_id=first.env_id,
        )
        for name in (*FLOAT_FIELDS, VERSION_FIELD):
            values = [getattr(p, name) for p in parts]
            if all(v is not None and v.n_rows == p.size for v, p in zip(values, parts, strict=True)):
                setattr(merged, name, Ragged.concat(values))
        for name in META_FIELDS:
            values = [p.meta.get(name) for p in parts]
            if name in ("generation_params", "group_overrides"):
                if values[0] is not None:
                    merged.meta[name] = values[0]
            elif all(isinstance(v, list) for v in values):
                merged.meta[name] = [x for v in values for x in v]
        versions = [p.policy_version for p in parts if p.policy_version is not None]
        merged.policy_version = min(versions) if versions else None
        return merged


def memory_owner(a: np.ndarray) -> Any:
    """The object that owns ``a``'s memory (through views and memoryviews)."""
    base: Any = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def _in_own_mapping(arrays: list[np.ndarray], total: int, min_bytes: int) -> bool:
    large = [a for a in arrays if a.nbytes >= min_bytes // 16]
    owners = {id(owner): owner for owner in map(memory_owner, large)}
    if len(owners) != 1:
        return False
    (owner,) = owners.values()
    return isinstance(owner, mmap.mmap) and len(owner) <= 2 * total


def _check_rows(name: str, arr: Ragged, lengths: np.ndarray, *, allow_empty: bool) -> None:
    n = len(lengths)
    if arr.n_rows != n:
        if allow_empty and arr.n_rows == 0:
            return
        raise InvalidInput(
            f"{name} has {arr.n_rows} rows but tokens has {n} sequences; send one row per sequence",
            field=name,
        )
    mismatch = np.flatnonzero(arr.lengths != lengths)
    if mismatch.size:
        i = int(mismatch[0])
        raise InvalidInput(
            f"{name}[{i}] has {int(arr.lengths[i])} values but tokens[{i}] has {int(lengths[i])}; "
            "make every row as long as its token row",
            field=name,
            index=i,
        )
