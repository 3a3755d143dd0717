"""How many weight versions sampled a group: the per-token versions (:attr:`Group.token_versions`) read as a
tally of partial and whole groups and samples, and of each group's version span.

A group (or one of its samples) is **partial** when its sampled tokens come from more than one policy version (a
weight push happened while it was generated), **whole** when they all come from one, and **unknown** when nothing
says: the group has no ``token_versions`` (a producer on the OpenAI completions route, which gives no per-token
versions, or an outside environment), or the group or sample has no sampled position at all. Unknown groups are
counted as such, never as whole. The **version span** of a group is its newest sampled token's version minus its
oldest (0: whole; defined only where the versions are known).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rollhub.experience.group import NOT_SAMPLED, Group

Versions = Literal["partial", "whole", "unknown"]
"""What the per-token versions say of a group or a sample."""
KINDS: tuple[Versions, ...] = ("partial", "whole", "unknown")


def version_span(group: Group) -> int | None:
    """The newest sampled token's version minus the oldest over every sample of ``group``; ``None`` without
    ``token_versions`` (or with none of its rows) or without a sampled position."""
    versions = group.token_versions
    if versions is None or versions.n_rows != group.size:
        return None
    sampled = versions.data[versions.data != NOT_SAMPLED]
    return int(sampled.max() - sampled.min()) if sampled.size else None


def sample_spans(group: Group) -> list[int | None]:
    """:func:`version_span` of each sample of ``group`` on its own (``None`` where unknown)."""
    versions = group.token_versions
    if versions is None or versions.n_rows != group.size:
        return [None] * group.size
    out: list[int | None] = []
    for row in versions.rows():
        sampled = row[row != NOT_SAMPLED]
        out.append(int(sampled.max() - sampled.min()) if sampled.size else None)
    return out


def kind_of(span: int | None) -> Versions:
    """``partial`` for a span above 0, ``whole`` for 0, ``unknown`` for ``None``."""
    return "unknown" if span is None else "partial" if span > 0 else "whole"


@dataclass
class VersionTally:
    """Counts over the groups :meth:`add` was given: groups and samples per :data:`Versions` kind, and groups per
    version span. Plain data (:meth:`to_json` / :meth:`from_json` round-trip it through a checkpoint).

    Attributes:
        groups: groups per kind (``partial``, ``whole``, ``unknown``).
        samples: samples (sequences) per kind, each judged by its own tokens.
        spans: groups per version span (known groups only; ``sum(spans.values())`` is partial + whole groups).
    """

    groups: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    samples: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    spans: dict[int, int] = field(default_factory=dict)

    def add(self, groups: Iterable[Group]) -> None:
        """Count ``groups``."""
        for group in groups:
            span = version_span(group)
            self.groups[kind_of(span)] += 1
            if span is not None:
                self.spans[span] = self.spans.get(span, 0) + 1
            for sample in sample_spans(group):
                self.samples[kind_of(sample)] += 1

    @staticmethod
    def ratio(counts: Mapping[str, int]) -> float | None:
        """Partial over partial + whole (the unknown left out); ``None`` when nothing is known."""
        known = counts["partial"] + counts["whole"]
        return round(counts["partial"] / known, 6) if known else None

    def summary(self) -> dict[str, Any]:
        """The run summary's view: per kind counts with ``partial_ratio`` (over the known only) for groups and
        samples, groups per span (keys as strings, ascending) and the largest span (``None``: none known)."""
        return {
            "groups": {**self.groups, "partial_ratio": self.ratio(self.groups)},
            "samples": {**self.samples, "partial_ratio": self.ratio(self.samples)},
            "span_counts": {str(s): n for s, n in sorted(self.spans.items())},
            "max_span": max(self.spans) if self.spans else None,
        }

    def to_json(self) -> dict[str, Any]:
        """Plain data for a checkpoint."""
        spans = {str(k): v for k, v in self.spans.items()}
        return {"groups": dict(self.groups), "samples": dict(self.samples), "spans": spans}

    @classmethod
    def from_json(cls, values: Mapping[str, Any] | None) -> VersionTally:
        """The tally :meth:`to_json` gave (an empty one for ``None``)."""
        if not values:
            return cls()
        return cls(
            groups={k: int(values["groups"].get(k, 0)) for k in KINDS},
            samples={k: int(values["samples"].get(k, 0)) for k in KINDS},
            spans={int(k): int(v) for k, v in values["spans"].items()},
        )
