"""Load a script that is not part of the package (``benchmarks/``, the engine-side worker extension, the docs
hooks) as a module, so tests can call its pieces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """The file ``path``, imported under ``name`` (default: its stem) and kept in ``sys.modules`` (dataclasses
    defined in it need that)."""
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/NAME.py``."""
    return load_script(BENCHMARKS / f"{name}.py")
