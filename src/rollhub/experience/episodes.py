"""Which rows of a group belong to which episode: the per-row record a multi-turn group carries.

A group of multi-turn episodes (:mod:`rollhub.envs.episode`) holds ``n`` episodes of one task. An episode is one
token row while its chat template only appends to the conversation, and starts a further row whenever the
template rewrites earlier turns, so a group can hold more rows than episodes. Each row says which episode it
belongs to in the Atropos item's per-sequence ``overrides`` list, under the key ``"rollhub"``::

    overrides[i]["rollhub"] = {
        "episode": "7*5/2/9f0c",  # unique; the rows of one episode are adjacent, in order
        "row": 0,               # the row's position inside its episode
        "turns": 3,             # model turns of the whole episode
        "truncated": False,     # the episode ran out of its token budget, its turn limit, or a turn was cut
        "finish": "done",       # why the episode ended (see rollhub.envs.episode.types.Finish)
        "versions": [[4, 9, 17], ...],  # optional: [policy_version, start, end) spans of sampled tokens
    }

``overrides`` is a per-sequence field, so the record travels with its row through every path (JSON, msgpack,
sqlite, files, pickling) and through the buffer's merging of held groups, which concatenates per-sequence fields
(episode ids are unique beyond their group, so merged parts never mix). The buffer sizes such a group by its
episodes (:func:`episode_count`): ``group_size`` and ``batch_size`` count episodes for it.
Every row of an episode carries the episode's score, so a consumer that knows nothing of episodes still sees one
score per sequence; a consumer that does (the GRPO trainer) compares episodes, not rows
(:func:`episode_index`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollhub.experience.group import Group

ROW_KEY = "rollhub"


def row_records(group: Group) -> list[dict[str, Any]] | None:
    """The per-row episode records of ``group``, or ``None`` unless every row has one."""
    overrides = group.meta.get("overrides")
    if not isinstance(overrides, list) or len(overrides) != group.size:
        return None
    records = []
    for item in overrides:
        record = item.get(ROW_KEY) if isinstance(item, dict) else None
        if not isinstance(record, dict) or not isinstance(record.get("episode"), str):
            return None
        records.append(record)
    return records


def episode_index(group: Group) -> np.ndarray | None:
    """``[rows]``: the index of each row's episode, numbered by first appearance (``None`` for a group without
    episode records: one episode per row)."""
    records = row_records(group)
    if records is None:
        return None
    numbers: dict[str, int] = {}
    return np.asarray([numbers.setdefault(r["episode"], len(numbers)) for r in records], dtype=np.int64)


def episode_count(group: Group) -> int:
    """The episodes in ``group``: distinct episode ids when every row has a record, else its rows."""
    index = episode_index(group)
    return group.size if index is None else int(index.max()) + 1


def first_rows(index: np.ndarray) -> np.ndarray:
    """The first row of each episode of an :func:`episode_index` (where its score is read)."""
    _, first = np.unique(index, return_index=True)
    return first
