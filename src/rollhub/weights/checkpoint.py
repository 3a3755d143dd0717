"""Directory checkpoints of policy weights, for trainers and inference servers outside the Ray cluster.

Layout under ``root``::

    step_00000012/model.safetensors   # one complete checkpoint per directory
    step_00000013/model.safetensors
    LATEST                            # text: the newest step, replaced atomically

Guarantees:

- **No partial reads.** A checkpoint is written (and fsynced, unless the directory is not ``durable``) in a
  hidden temporary directory, then renamed to ``step_<n>`` in one atomic ``rename``; readers only ever open
  ``step_<n>`` directories, so they see a whole checkpoint or none. ``LATEST`` is only a hint written after the
  rename; readers fall back to listing.
- **Keep the last N.** After each save, all but the newest ``keep_last`` checkpoints are deleted. A reader
  that lost the race with a deletion retries on the newest checkpoint instead of failing.
- Tensors are stored as safetensors, written by :func:`write_safetensors` straight from each tensor's memory
  (numpy arrays, and torch tensors of every dtype, ``bfloat16`` included; no serialized copy of the whole is
  made). A file loads as torch tensors or as numpy arrays where numpy has the dtype. The step and the caller's
  metadata (JSON) travel in the safetensors header.
- Loading gives numpy arrays, except that a tensor whose dtype numpy lacks (``bfloat16``, the ``float8``
  types) comes back as a torch tensor; ``as_torch=True`` gives torch tensors throughout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load

from rollhub.errors import RollhubError

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_FILE = "model.safetensors"
_LATEST = "LATEST"


class CheckpointError(RollhubError):
    """A checkpoint that is missing, unreadable or cannot be written."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One loaded checkpoint.

    Attributes:
        step: the trainer step of the weights.
        tensors: parameter name -> numpy array, or torch tensor where numpy lacks the dtype (``bfloat16``) or
            the checkpoint was loaded with ``as_torch=True``.
        metadata: the JSON metadata given at save time.
    """

    step: int
    tensors: dict[str, Any]
    metadata: dict[str, Any]

    @property
    def version(self) -> int:
        """The policy version of the weights (``step``), as :class:`rollhub.weights.WeightUpdate` names it."""
        return self.step

    @property
    def weights(self) -> dict[str, Any]:
        """The parameter arrays (``tensors``), as :class:`rollhub.weights.WeightUpdate` names them."""
        return self.tensors


_NUMPY_DTYPES = frozenset({"F64", "F32", "F16", "I64", "U64", "I32", "U32", "I16", "U16", "I8", "U8", "BOOL"})


def _is_torch(value: Any) -> bool:
    return hasattr(value, "detach")  # a torch tensor; avoids importing torch for numpy-only checkpoints


# safetensors dtype names, by numpy dtype (little-endian) and by torch dtype name.
_NUMPY_CODES = {"<f8": "F64", "<f4": "F32", "<f2": "F16", "<i8": "I64", "<u8": "U64", "<i4": "I32", "<u4": "U32",
                "<i2": "I16", "<u2": "U16", "|i1": "I8", "|u1": "U8", "|b1": "BOOL"}  # fmt: skip
_TORCH_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32",
                "uint64": "U64"}  # fmt: skip


def _raw(name: str, value: Any) -> tuple[str, list[int], Any]:
    """``(dtype code, shape, bytes view)`` of one tensor, its memory viewed as bytes (copied only when it is not
    contiguous, or big-endian)."""
    if _is_torch(value):
        import torch

        t = value.detach().cpu().contiguous()
        code = _TORCH_CODES.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store; cast it")
        return code, list(t.shape), t.reshape(-1).view(torch.uint8).numpy()
    a = np.ascontiguousarray(np.asarray(value))
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    code = _NUMPY_CODES.get(a.dtype.str)
    if code is None:
        raise CheckpointError(f"tensor {name!r} has dtype {a.dtype}, which safetensors cannot store; cast it")
    return code, list(a.shape), a.reshape(-1).view(np.uint8)


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, Any], metadata: dict[str, str],
                      fsync: bool = True) -> int:  # fmt: skip
    """Write ``tensors`` (numpy arrays or torch tensors of any dtype) to ``path`` as one safetensors file, straight
    from each tensor's memory: no serialized copy of the whole is made. Tensors sharing memory (tied embeddings)
    are each written whole. An existing file is overwritten in place (its pages are reused, which on tmpfs saves
    allocating them again) and cut to the new length.

    Returns:
        the file's size in bytes.

    Raises:
        CheckpointError: a tensor has a dtype safetensors cannot store.
    """
    raws = [(name, *_raw(name, value)) for name, value in tensors.items()]
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, code, shape, data in raws:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    with open(fd, "wb", buffering=0) as fh:
        fh.write(len(text).to_bytes(8, "little") + text)
        for _name, _code, _shape, data in raws:
            view = memoryview(data)
            while view:  # a raw write may take less than it was given
                view = view[fh.write(view) :]
        size = fh.tell()
        fh.truncate(size)
        if fsync:
            os.fsync(fh.fileno())
    return size


def _deserialize(blob: bytes, as_torch: bool) -> dict[str, Any]:
    """The tensors of ``blob``: numpy arrays (torch tensors for a dtype numpy lacks), or torch throughout.

    Raises:
        ValueError, SafetensorError: ``blob`` is not a safetensors file.
    """
    dtypes = {entry.get("dtype") for name, entry in _header(blob).items() if name != "__metadata__"}
    if not as_torch and dtypes <= _NUMPY_DTYPES:
        return st_load(blob)
    from safetensors.torch import load as st_load_torch

    tensors = st_load_torch(blob)
    if as_torch:
        return tensors
    out = {}
    for name, tensor in tensors.items():
        try:
            out[name] = tensor.numpy()
        except TypeError:  # numpy has no such dtype (bfloat16, float8): it stays a torch tensor
            out[name] = tensor
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointDirectory:
    """Atomic, pruned checkpoints of weights in one directory (see the module docstring).

    Args:
        root: the directory (created if missing).
        keep_last: how many of the newest checkpoints to keep (at least 1).
        durable: fsync each checkpoint before it is renamed into place (off for a directory that only has to
            outlive the process, e.g. on tmpfs: a checkpoint is still never seen half written).
    """

    def __init__(self, root: str | os.PathLike[str], keep_last: int = 3, durable: bool = True) -> None:
        if keep_last < 1:
            raise CheckpointError(f"keep_last {keep_last} must be at least 1")
        self.root = Path(root)
        self.keep_last = keep_last
        self.durable = durable
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, step: int) -> Path:
        """The directory that holds (or would hold) the checkpoint of ``step``."""
        return self.root / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present, oldest first."""
        out = []
        for entry in os.listdir(self.root):
            m = _STEP_DIR.match(entry)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def save(self, step: int, tensors: Mapping[str, Any], metadata: dict[str, Any] | None = None) -> Path:
        """Write the checkpoint of ``step`` atomically, update ``LATEST``, prune old ones.

        ``tensors`` maps names to numpy arrays or torch tensors of any dtype (``bfloat16`` included); they are
        stored as they are, dtype kept (see the module docstring), straight from their memory
        (:func:`write_safetensors`).

        Raises:
            CheckpointError: ``step`` is negative or already saved.
        """
        header = {"step": str(step), "metadata": json.dumps(metadata or {})}
        return self._commit(step, lambda file: write_safetensors(file, tensors, header, fsync=self.durable))

    def save_copy(self, step: int, source: str | os.PathLike[str]) -> Path:
        """Save as the checkpoint of ``step`` a copy of ``source``, the ``model.safetensors`` of a checkpoint of
        the same step written elsewhere (e.g. by a non-durable directory on tmpfs), atomically as :meth:`save`.

        Raises:
            CheckpointError: ``step`` is negative or already saved, or ``source`` is not a checkpoint of ``step``.
        """
        with open(source, "rb") as fh:
            head = fh.read(8)
            try:
                meta = _read_header(head + fh.read(int.from_bytes(head, "little")))
            except ValueError as exc:
                raise CheckpointError(f"{source} is not a rollhub checkpoint: {exc}") from None
        if meta.get("step") != str(step):
            raise CheckpointError(f"{source} holds step {meta.get('step')}, not {step}; copy the right file")

        def copy(file: Path) -> None:
            shutil.copyfile(source, file)
            if self.durable:
                with open(file, "rb+") as fh:
                    os.fsync(fh.fileno())

        return self._commit(step, copy)

    def _commit(self, step: int, write: Callable[[Path], object]) -> Path:
        """``write(file)`` in a hidden directory, then rename it to the checkpoint of ``step``, fsynced when
        durable; ``LATEST`` updated, old checkpoints pruned."""
        if step < 0:
            raise CheckpointError(f"step {step} must be >= 0")
        final = self.path(step)
        if final.exists():
            raise CheckpointError(f"checkpoint {final} already exists; save each step once")
        tmp = self.root / f".tmp-{step:08d}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            write(tmp / _FILE)
            if self.durable:
                _fsync_dir(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.durable:
            _fsync_dir(self.root)
        self._write_latest(step)
        self._prune()
        return final

    def _write_latest(self, step: int) -> None:
        tmp = self.root / f".{_LATEST}.{uuid.uuid4().hex}"
        tmp.write_text(str(step))
        os.replace(tmp, self.root / _LATEST)

    def _prune(self) -> None:
        for old in self.steps()[: -self.keep_last]:
            # Rename first so a reader never opens a directory that is half deleted.
            doomed = self.root / f".del-{old:08d}-{uuid.uuid4().hex}"
            try:
                os.rename(self.path(old), doomed)
            except FileNotFoundError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)

    def latest_step(self) -> int | None:
        """The newest complete step, or None when the directory holds no checkpoint."""
        steps = self.steps()
        return steps[-1] if steps else None

    def load(self, step: int, as_torch: bool = False) -> Checkpoint:
        """Load the checkpoint of ``step``: numpy arrays (torch tensors where numpy lacks the dtype, e.g.
        ``bfloat16``), or with ``as_torch`` torch tensors throughout; dtypes are those saved.

        Raises:
            CheckpointError: no such checkpoint (never saved or already pruned), or it cannot be parsed.
        """
        try:
            blob = (self.path(step) / _FILE).read_bytes()
        except FileNotFoundError:
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.root} (present: {self.steps()}); "
                "it was never saved or was pruned; load the latest instead"
            ) from None
        try:
            tensors = _deserialize(blob, as_torch)
            header = _read_header(blob)
        except (SafetensorError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {self.path(step)} is unreadable: {exc}") from None
        return Checkpoint(step=int(header["step"]), tensors=tensors, metadata=json.loads(header["metadata"]))

    def load_latest(self, attempts: int = 5, as_torch: bool = False) -> Checkpoint:
        """Load the newest checkpoint (as :meth:`load` does), retrying if a concurrent prune deletes it mid-read.

        Raises:
            CheckpointError: the directory holds no checkpoint.
        """
        for _ in range(attempts):
            step = self.latest_step()
            if step is None:
                break
            try:
                return self.load(step, as_torch)
            except CheckpointError:
                if self.path(step).exists():
                    raise
        raise CheckpointError(f"no checkpoint in {self.root}; save one first or check the path")


def _header(blob: bytes) -> dict[str, Any]:
    """The safetensors JSON header of ``blob`` (raises ValueError when there is none)."""
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    if len(blob) < 8 + n or not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise ValueError("no safetensors header")
    return header


def _read_header(blob: bytes) -> dict[str, str]:
    meta = _header(blob).get("__metadata__") or {}
    if "step" not in meta or "metadata" not in meta:
        raise ValueError("the safetensors header lacks rollhub's 'step' and 'metadata' entries")
    return meta


class CheckpointPublisher:
    """Publishes weights by saving a checkpoint per step (the trainer side; a
    :class:`rollhub.weights.WeightPublisher`)."""

    def __init__(self, directory: CheckpointDirectory) -> None:
        self.directory = directory

    def publish(self, step: int, state: Mapping[str, Any], metadata: dict[str, Any] | None = None) -> None:
        """Save ``state`` as the checkpoint of ``step`` (atomic; old ones pruned)."""
        self.directory.save(step, state, metadata)


class CheckpointSubscriber:
    """Polls a checkpoint directory for weights newer than the last ones received (the inference side; a
    :class:`rollhub.weights.WeightSubscriber` whose updates are :class:`Checkpoint`s, which carry ``version``
    and ``weights`` like a :class:`rollhub.weights.WeightUpdate`)."""

    def __init__(self, directory: CheckpointDirectory) -> None:
        self.directory = directory
        self.last_step = -1

    @property
    def loaded_version(self) -> int | None:
        """The version last returned by :meth:`poll` (``None`` before the first)."""
        return None if self.last_step < 0 else self.last_step

    def poll(self) -> Checkpoint | None:
        """The newest checkpoint if it is newer than the last one returned, else None."""
        step = self.directory.latest_step()
        if step is None or step <= self.last_step:
            return None
        ckpt = self.directory.load_latest()
        self.last_step = ckpt.step
        return ckpt
