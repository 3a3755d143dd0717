"""What every Prometheus text page of rollhub's shares: label values escaped as the exposition format asks."""

from __future__ import annotations


def escape_label(value: object) -> str:
    """``value`` as a label value inside double quotes: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
