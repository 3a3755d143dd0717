"""Experiment trackers behind one small protocol: ``init``, ``log``, ``finish``.

* :class:`WandbTracker`: Weights & Biases (``pip install 'rollhub[wandb]'``). It passes no ``mode``
  unless given one, so ``WANDB_MODE=offline`` (or ``disabled``) in the environment is honoured.
* :class:`JsonlTracker`: one JSON object per line in a file; the init line carries the run's names.
* :class:`NullTracker`: records nothing.

Pick one by name with :func:`make_tracker` (``"wandb"``, ``"jsonl:PATH"``, ``"none"``).
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rollhub.client.errors import TrackerUnavailable
from rollhub.errors import ConfigError

_NO_WANDB = (
    "the W&B tracker needs the wandb package: install it with pip install 'rollhub[wandb]', "
    "or use tracker='jsonl:PATH' or 'none'"
)


@runtime_checkable
class Tracker(Protocol):
    """Where a rollout handler records its metrics.

    ``init`` is called once, before any ``log``; ``finish`` once at the end (also after a failure).
    """

    def init(self, *, project: str | None, group: str | None, name: str, config: dict[str, Any]) -> None:
        """Start a run named ``name`` in ``project`` / ``group`` (None: the tracker's default)."""
        ...

    def log(self, metrics: dict[str, Any]) -> None:
        """Record metrics (name -> number, or a short string for events)."""
        ...

    def finish(self) -> None:
        """Close the run; further ``log`` calls are ignored."""
        ...


class NullTracker:
    """A tracker that records nothing."""

    def init(self, *, project: str | None, group: str | None, name: str, config: dict[str, Any]) -> None:
        """Do nothing."""

    def log(self, metrics: dict[str, Any]) -> None:
        """Do nothing."""

    def finish(self) -> None:
        """Do nothing."""


class JsonlTracker:
    """Appends one JSON line per call to ``path``: ``{"event": "init", ...}``, metric lines with a ``time``
    field, and ``{"event": "finish"}``. Lines are flushed as written, so the file can be tailed.

    Args:
        path: the file (its directory is created).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file: Any = None

    def _write(self, obj: dict[str, Any]) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write(json.dumps(obj, default=_plain) + "\n")
            self._file.flush()

    def init(self, *, project: str | None, group: str | None, name: str, config: dict[str, Any]) -> None:
        """Open the file and write the init line with the run's names and config."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._file = self.path.open("a", encoding="utf-8")
        self._write(
            {
                "event": "init",
                "time": time.time(),
                "project": project,
                "group": group,
                "name": name,
                "config": config,
            }
        )

    def log(self, metrics: dict[str, Any]) -> None:
        """Write one metrics line."""
        self._write({"time": time.time(), **metrics})

    def finish(self) -> None:
        """Write the finish line and close the file."""
        self._write({"event": "finish", "time": time.time()})
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as plain JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


class WandbTracker:
    """Weights & Biases; set ``WANDB_MODE=offline`` to run without network.

    Raises:
        TrackerUnavailable: at construction, when wandb is not installed (so a handler fails before it
            registers, not after).

    Args:
        entity: the W&B entity (None: wandb's default).
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; None leaves it to ``WANDB_MODE``.
        dir: where wandb writes its files (None: wandb's default, ``./wandb``).
        **init_kwargs: more ``wandb.init`` arguments (tags, notes, ...).
    """

    def __init__(
        self,
        *,
        entity: str | None = None,
        mode: str | None = None,
        dir: str | Path | None = None,
        **init_kwargs: Any,
    ) -> None:
        if importlib.util.find_spec("wandb") is None:
            raise TrackerUnavailable(_NO_WANDB)
        self.entity = entity
        self.mode = mode
        self.dir = None if dir is None else str(dir)
        self.init_kwargs = init_kwargs
        self.run: Any = None

    def init(self, *, project: str | None, group: str | None, name: str, config: dict[str, Any]) -> None:
        """``wandb.init`` with the server's project and group and the handler's unique name."""
        try:
            import wandb
        except ImportError:
            raise TrackerUnavailable(_NO_WANDB) from None
        kwargs: dict[str, Any] = dict(self.init_kwargs)
        for key, value in (("entity", self.entity), ("mode", self.mode), ("dir", self.dir)):
            if value is not None:
                kwargs[key] = value
        self.run = wandb.init(project=project or None, group=group or None, name=name, config=config, **kwargs)

    def log(self, metrics: dict[str, Any]) -> None:
        """``run.log(metrics)``."""
        if self.run is not None:
            self.run.log(metrics)

    def finish(self) -> None:
        """``run.finish()``."""
        if self.run is not None:
            self.run.finish()
            self.run = None


def make_tracker(spec: str | Tracker | None) -> Tracker:
    """The tracker named by ``spec``: ``"wandb"``, ``"jsonl:PATH"``, ``"none"`` / None, or a tracker as is.

    Raises:
        ConfigError: an unknown name.
    """
    if spec is None or spec == "none":
        return NullTracker()
    if not isinstance(spec, str):
        return spec
    if spec == "wandb":
        return WandbTracker()
    if spec.startswith("jsonl:") and len(spec) > len("jsonl:"):
        return JsonlTracker(spec[len("jsonl:") :])
    raise ConfigError(f"unknown tracker {spec!r}; use 'wandb', 'jsonl:PATH' or 'none'")


__all__ = ["JsonlTracker", "NullTracker", "Tracker", "WandbTracker", "make_tracker"]
