"""The ``--log-level`` option of the long-running commands (``rollhub serve``, ``rollhub gateway``) and the log
format they write to stderr."""

from __future__ import annotations

import argparse
import logging

LEVELS = ("critical", "error", "warning", "info", "debug")
"""The ``--log-level`` choices, quietest first (``uvicorn`` takes the same names)."""


def add_log_level(p: argparse.ArgumentParser, who: str) -> None:
    """``--log-level`` (default ``info``), its help saying how much ``who`` (e.g. ``"the server"``) logs."""
    p.add_argument("--log-level", default="info", choices=list(LEVELS), help=f"how much {who} logs (default info)")


def configure_logging(level: str) -> None:
    """Log to stderr from ``level`` (a ``--log-level`` choice) up, each line with its time, level and logger."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
