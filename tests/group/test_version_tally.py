"""What the per-token versions say of a group: partial, whole or unknown groups and samples, and version spans;
a group without per-token versions counts as unknown, never as whole."""

from __future__ import annotations

import numpy as np

from rollhub.experience import Group, Ragged
from rollhub.experience.group import NOT_SAMPLED
from rollhub.experience.versions import VersionTally, sample_spans, version_span


def group(versions: list[list[int]] | None, zero_rows: bool = False) -> Group:
    """A group of one sequence per row of ``versions`` (2 prompt tokens, then one token per completion version
    given; ``None``: no ``token_versions``; ``zero_rows``: ``token_versions = []``)."""
    rows = versions or [[NOT_SAMPLED, NOT_SAMPLED, 0]]
    tokens = Ragged.from_rows([np.arange(len(r)) for r in rows], np.int32)
    out = Group(tokens=tokens, masks=tokens, scores=np.zeros(len(rows)))
    if zero_rows:
        out.token_versions = Ragged.from_rows([], np.int64)
    elif versions is not None:
        out.token_versions = Ragged.from_rows([np.array(r, np.int64) for r in versions], np.int64)
    return out


P = NOT_SAMPLED  # a prompt position


def test_a_group_sampled_by_one_version_is_whole_and_one_that_crossed_a_push_is_partial() -> None:
    whole = group([[P, P, 3, 3], [P, P, 3]])
    partial = group([[P, P, 3, 3], [P, P, 3, 4, 5]])
    assert version_span(whole) == 0 and sample_spans(whole) == [0, 0]
    assert version_span(partial) == 2 and sample_spans(partial) == [0, 2]


def test_the_span_is_over_the_whole_group_even_when_each_sample_is_whole() -> None:
    g = group([[P, 2, 2], [P, 4, 4]])  # two samples, each of one version, but different ones
    assert version_span(g) == 2 and sample_spans(g) == [0, 0]
    tally = VersionTally()
    tally.add([g])
    assert tally.groups == {"partial": 1, "whole": 0, "unknown": 0}
    assert tally.samples == {"partial": 0, "whole": 2, "unknown": 0}


def test_groups_without_per_token_versions_are_unknown_not_whole() -> None:
    missing, empty = group(None), group(None, zero_rows=True)
    unsampled = group([[P, P], [P, P]])  # versions given, but no sampled position
    for g in (missing, empty, unsampled):
        assert version_span(g) is None and set(sample_spans(g)) == {None}
    tally = VersionTally()
    tally.add([missing, empty, unsampled])
    assert tally.groups == {"partial": 0, "whole": 0, "unknown": 3}
    assert tally.samples["unknown"] == 1 + 1 + 2 and tally.spans == {}
    summary = tally.summary()
    assert summary["groups"]["partial_ratio"] is None and summary["samples"]["partial_ratio"] is None
    assert summary["span_counts"] == {} and summary["max_span"] is None


def test_the_tally_counts_ratios_over_the_known_and_spans_per_value() -> None:
    tally = VersionTally()
    tally.add([group([[P, 1, 1]]), group([[P, 1, 2]]), group([[P, 0, 3]]), group([[P, 5]]), group(None)])
    assert tally.groups == {"partial": 2, "whole": 2, "unknown": 1}
    assert tally.spans == {0: 2, 1: 1, 3: 1}
    summary = tally.summary()
    assert summary["groups"] == {"partial": 2, "whole": 2, "unknown": 1, "partial_ratio": 0.5}
    assert summary["samples"]["partial_ratio"] == 0.5
    assert summary["span_counts"] == {"0": 2, "1": 1, "3": 1} and summary["max_span"] == 3


def test_the_tally_round_trips_through_a_checkpoint_and_goes_on_counting() -> None:
    tally = VersionTally()
    tally.add([group([[P, 1, 2]]), group(None)])
    again = VersionTally.from_json(tally.to_json())
    assert again == tally
    again.add([group([[P, 7, 7]])])
    assert again.groups == {"partial": 1, "whole": 1, "unknown": 1} and again.spans == {1: 1, 0: 1}
    assert VersionTally.from_json(None) == VersionTally()
