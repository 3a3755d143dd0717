"""One episode as it runs and after it ended, and the :class:`~rollhub.experience.Group` of ``n`` episodes of a task.

The group is laid out as every group is (:mod:`rollhub.envs.group.scored`): int32 ``tokens``, ``masks`` with
``-100`` on every position not sampled by the policy (prompt, tool results, template tokens, wherever they are in
the row), float ``inference_logprobs`` (``1.0`` off the sampled positions), one score per row. Rows are the
episodes' rows in order, the rows of one episode adjacent; each row names its episode in ``overrides``
(:mod:`rollhub.experience.episodes`) and carries its episode's score. ``messages`` holds each row's episode's
whole conversation; ``group_overrides["rollhub"]`` holds the environment's name, the task id, one ``correct``
flag per row, and the episode counts (``episodes``, ``truncated_episodes``, ``forked_episodes``).
``policy_version`` is the oldest version that sampled any of its tokens (staleness is judged by the oldest
token); when the policy reported a version for every sampled position, ``token_versions`` holds them per token
(``-1`` on every position it did not sample).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollhub.envs.episode.tokens import UNVERSIONED, EpisodeTokens
from rollhub.envs.episode.types import TRUNCATED, Finish, Outcome, Task
from rollhub.envs.group.scored import INFO_KEY, group_of_rows
from rollhub.errors import InvalidInput
from rollhub.experience import Group, Ragged
from rollhub.experience.episodes import ROW_KEY
from rollhub.experience.group import PROMPT_MASK


@dataclass
class Episode:
    """One episode: its conversation, its exact tokens and its rewards.

    Attributes:
        task: the task it started from.
        episode_id: unique (``"<task id>/<k>/<random hex>"``).
        tokens: the rows (:class:`~rollhub.envs.episode.tokens.EpisodeTokens`).
        messages: the conversation: the task's messages, then each model turn (``assistant``, its text exactly
            as sampled) and the environment's messages.
        turn_rewards: one reward per model turn.
        finish: why it ended (``None`` while it runs).
        outcome: the environment's judgement (``None`` until it ended and was judged).
        forks: why each row after the first was started.
        state: the environment's own per-episode values.
    """

    task: Task
    episode_id: str
    tokens: EpisodeTokens
    messages: list[dict[str, Any]]
    turn_rewards: list[float] = field(default_factory=list)
    finish: Finish | None = None
    outcome: Outcome | None = None
    forks: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def turns(self) -> int:
        """Model turns taken."""
        return len(self.turn_rewards)

    @property
    def truncated(self) -> bool:
        """It ended on a budget, not by the environment: a turn cut at its cap, the episode's token budget, or
        its turn limit."""
        return self.finish in TRUNCATED

    def score(self, discount: float = 1.0) -> float:
        """``sum_t discount**t * r_t`` with the outcome's reward added to the last turn's (see
        :mod:`rollhub.envs.episode.base`)."""
        rewards = list(self.turn_rewards) or [0.0]
        rewards[-1] += self.outcome.reward if self.outcome is not None else 0.0
        return float(sum(r * discount**t for t, r in enumerate(rewards)))


def episodes_to_group(env_name: str, episodes: Sequence[Episode], discount: float = 1.0,
                      generation_params: Mapping[str, Any] | None = None) -> Group:  # fmt: skip
    """The group of ``episodes`` (all of one task, all ended and judged); see the module docstring.

    Raises:
        InvalidInput: an episode has not ended or was not judged, or was aborted (leave its task out).
    """
    tokens, masks, logprobs, scores, overrides, messages, correct = [], [], [], [], [], [], []
    versions: list[int] = []
    token_versions: list[np.ndarray] = []
    for ep in episodes:
        if ep.finish is None or ep.outcome is None or ep.finish == "abort":
            raise InvalidInput(f"episode {ep.episode_id!r} ended with {ep.finish!r} and outcome {ep.outcome!r}; "
                               "only ended, judged, unaborted episodes make a group")  # fmt: skip
        score = ep.score(discount)
        for j, row in enumerate(ep.tokens.rows):
            tokens.append(np.asarray(row.tokens, np.int32))
            masks.append(np.asarray(row.mask, np.int32))
            logprobs.append(np.asarray(row.logprobs, np.float64))
            token_versions.append(np.asarray(row.versions, np.int64))
            scores.append(score)
            record: dict[str, Any] = {"episode": ep.episode_id, "row": j, "turns": ep.turns,
                                      "truncated": ep.truncated, "finish": ep.finish}  # fmt: skip
            if spans := row.version_spans():
                record["versions"] = spans
                versions += [s[0] for s in spans]
            overrides.append({ROW_KEY: record})
            messages.append([dict(m) for m in ep.messages])
            correct.append(bool(ep.outcome.correct))
    info = {
        "env_name": env_name,
        "example_id": episodes[0].task.id if episodes else "",
        "correct": correct,
        "episodes": len(episodes),
        "truncated_episodes": sum(ep.truncated for ep in episodes),
        "forked_episodes": sum(len(ep.tokens.rows) > 1 for ep in episodes),
    }
    meta: dict[str, Any] = {"group_overrides": {INFO_KEY: info}, "overrides": overrides, "messages": messages}
    if generation_params is not None:
        meta["generation_params"] = dict(generation_params)
    versioned = [v for v in versions if v != UNVERSIONED]
    group = group_of_rows(tokens, masks, logprobs, scores, meta, min(versioned) if versioned else None)
    if tokens and all(
        len(v) == len(m) and not ((v == UNVERSIONED) & (m != PROMPT_MASK)).any()
        for v, m in zip(token_versions, masks, strict=True)
    ):  # every sampled position has its version
        group.token_versions = Ragged.from_rows(token_versions, np.int64)
    return group
