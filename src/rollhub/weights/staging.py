"""The fast path of a weight push: versions staged in memory for the engines, written durably in the background.

A push on one machine needs the engine to read the new weights from a file, but not to wait until that file is
safe on disk. :class:`StagedVersions` keeps the versions the engines load in a staging directory on tmpfs
(``/dev/shm``): written without fsync, each in ``step_<n>/model.safetensors`` so an engine loads it like any
checkpoint, and the file of a version no longer needed is reused for the next one (overwritten in place, so
tmpfs does not allocate its pages again). :class:`DurableWriter` copies staged versions into the durable
:class:`~rollhub.weights.checkpoint.CheckpointDirectory` (written, fsynced, renamed) in a background thread:

- **in order, newest wins.** One version is written at a time, oldest first; a version still waiting when a
  newer one arrives is skipped (never written), so the durable directory only ever gains newer versions;
- **errors surface.** A failed write is kept and raised by the next :meth:`DurableWriter.raise_error` (the
  publisher's next push) or by :meth:`DurableWriter.close`;
- **from the staged file,** not from the caller's tensors, which the trainer may change in place right after
  the push.

On a crash the durable directory may lag the engines by the versions still staged or waiting (one or two):
the staging directory, in memory, is lost with the machine, and a process killed outright leaves it behind
until :func:`sweep_stale` (run when the next staging directory is made) removes it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollhub.weights.checkpoint import CheckpointDirectory, CheckpointError, write_safetensors

SHM = Path("/dev/shm")
_PREFIX = "rollhub-push-"
_FILE = "model.safetensors"
logger = logging.getLogger(__name__)


def make_staging_root(parent: str | os.PathLike[str] = SHM) -> Path:
    """A new staging directory under ``parent`` named for this process (``rollhub-push-<pid>-...``), after
    removing those of processes that no longer run (:func:`sweep_stale`).

    Raises:
        CheckpointError: ``parent`` is not a writable directory.
    """
    parent = Path(parent)
    if not (parent.is_dir() and os.access(parent, os.W_OK)):
        raise CheckpointError(f"{parent} is not a writable directory to stage weights in")
    sweep_stale(parent)
    return Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=parent))


def sweep_stale(parent: str | os.PathLike[str] = SHM) -> list[Path]:
    """Remove the staging directories under ``parent`` whose process is gone (killed before it could remove
    them); returns those removed. A directory whose process id is alive (or reused) is left alone."""
    removed = []
    for entry in Path(parent).glob(f"{_PREFIX}*"):
        pid = entry.name.removeprefix(_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StagedVersions:
    """Versions of the weights in a staging directory, newest kept, retired files reused (module docstring).

    Args:
        root: the staging directory (created if missing; :meth:`remove` deletes it).
        spares: how many retired files are kept to be overwritten by later versions.
    """

    def __init__(self, root: str | os.PathLike[str], spares: int = 1) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.spares = spares
        self._versions: list[int] = []
        self._spare: list[Path] = []  # retired version directories, their file kept for reuse
        self._lock = threading.Lock()

    def path(self, version: int) -> Path:
        """The directory an engine loads ``version`` from."""
        return self.root / f"step_{version:08d}"

    def versions(self) -> list[int]:
        """The versions staged, oldest first."""
        with self._lock:
            return list(self._versions)

    def newest(self) -> int | None:
        """The newest version staged (never retired), or ``None``."""
        with self._lock:
            return self._versions[-1] if self._versions else None

    def write(self, version: int, tensors: Mapping[str, Any]) -> Path:
        """Stage ``tensors`` as ``version`` (newer than every version staged) and return its directory, which holds
        one complete ``model.safetensors`` once this returns.

        Raises:
            CheckpointError: ``version`` is not newer than the newest staged, or a tensor cannot be stored.
        """
        with self._lock:
            if self._versions and version <= self._versions[-1]:
                raise CheckpointError(f"version {version} is not newer than the newest staged {self._versions[-1]}")
            spare = self._spare.pop() if self._spare else None
        final = self.path(version)
        if spare is None:
            final.mkdir()
        else:
            os.rename(spare, final)
        try:
            write_safetensors(final / _FILE, tensors, {"step": str(version), "metadata": "{}"}, fsync=False)
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)
            raise
        with self._lock:
            self._versions.append(version)
        return final

    def retire(self, keep: set[int]) -> list[int]:
        """Retire every staged version but the newest and those in ``keep`` (still to be written durably); their
        files become spares (up to ``spares``) or are deleted. Returns the versions retired."""
        with self._lock:
            doomed = [v for v in self._versions[:-1] if v not in keep]
            self._versions = [v for v in self._versions if v not in doomed]
            moves = []
            for version in doomed:
                if len(self._spare) < self.spares:
                    spare = self.root / f".spare-{uuid.uuid4().hex}"
                    os.rename(self.path(version), spare)  # under the lock: a write never takes a half-made spare
                    self._spare.append(spare)
                else:
                    moves.append(version)
        for version in moves:
            _remove(self.path(version))
        return doomed

    def remove(self) -> None:
        """Delete the staging directory and everything in it."""
        with self._lock:
            self._versions, self._spare = [], []
        shutil.rmtree(self.root, ignore_errors=True)


def _remove(path: Path) -> None:
    doomed = path.with_name(f".del-{uuid.uuid4().hex}")
    try:
        os.rename(path, doomed)  # gone from readers' view at once
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


class DurableWriter:
    """Copies staged versions into ``checkpoints`` in a background thread, in order, newest wins (module
    docstring).

    Args:
        checkpoints: the durable directory.
        staged: where the versions to copy are staged; a version is retired there once written (or skipped).
        keep_timings: how many ``(version, seconds)`` of finished writes :attr:`timings` keeps.
    """

    def __init__(self, checkpoints: CheckpointDirectory, staged: StagedVersions, keep_timings: int = 10_000) -> None:
        self.checkpoints = checkpoints
        self.staged = staged
        self.timings: list[tuple[int, float]] = []
        self.skipped: list[int] = []
        self._keep = keep_timings
        self._pending: int | None = None
        self._writing: int | None = None
        self._error: tuple[int, BaseException] | None = None
        self._closed = False
        self._cv = threading.Condition(threading.RLock())  # busy() is also called with it held
        self._thread = threading.Thread(target=self._run, name="durable-weights", daemon=True)

    def busy(self) -> set[int]:
        """The versions waiting or being written (their staged files must stay)."""
        with self._cv:
            return {v for v in (self._pending, self._writing) if v is not None}

    def submit(self, version: int) -> None:
        """Write staged ``version`` durably once the thread is free; a version still waiting is skipped."""
        with self._cv:
            if self._closed:
                raise CheckpointError("the durable writer is closed; make a new publisher")
            if self._pending is not None:
                self.skipped.append(self._pending)
            self._pending = version
            if not self._thread.is_alive():
                self._thread.start()
            self.staged.retire(self.busy())  # a skipped version's file becomes a spare
            self._cv.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until no version is waiting or being written; ``False`` if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._pending is not None or self._writing is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def raise_error(self) -> None:
        """Raise (once) the error of a background write that failed since the last call.

        Raises:
            CheckpointError: naming the version and the directory, chained to the cause.
        """
        with self._cv:
            failed, self._error = self._error, None
        if failed is not None:
            version, exc = failed
            raise CheckpointError(f"the durable copy of weight version {version} into {self.checkpoints.root} "
                                  f"failed ({type(exc).__name__}: {exc}); the engines were pushed, the durable "
                                  "checkpoint lags; free the disk or fix the directory") from exc  # fmt: skip

    def close(self) -> None:
        """Write the version still waiting, stop the thread, and raise an error not yet raised
        (:meth:`raise_error`)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        self.raise_error()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._pending is None:
                    return
                version, self._pending, self._writing = self._pending, None, self._pending
            started = time.perf_counter()
            try:
                self.checkpoints.save_copy(version, self.staged.path(version) / _FILE)
            except Exception as exc:
                logger.warning("durable copy of weight version %d failed: %s", version, exc)
                with self._cv:
                    self._error = self._error or (version, exc)
            else:
                self.timings = [*self.timings, (version, time.perf_counter() - started)][-self._keep :]
            with self._cv:  # retired before flush() sees the writer idle
                self._writing = None
                self.staged.retire(self.busy())
                self._cv.notify_all()
