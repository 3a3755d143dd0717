"""Scored completions as :class:`~rollhub.experience.Group` objects, and the statistics of a set of groups.

A group environment turns the completions of one prompt into one ``Group`` (numpy arrays, no Python lists
of ints), laid out exactly as the buffer server's item:

- ``tokens``: prompt then completion; ``masks``: ``-100`` (:data:`~rollhub.experience.group.PROMPT_MASK`) on
  prompt positions, the token id on completion ones;
- ``inference_logprobs``: ``1.0`` (:data:`~rollhub.experience.group.PROMPT_LOGPROB`) on prompt positions, the
  behaviour log-prob on completion ones;
- ``generation_params``: the sampling settings the completions were drawn with (:func:`sampled_with`), which the
  trainer reads to compute log-probs of the same distribution;
- ``token_versions`` (when every completion reports ``versions``, as the engine's token route does): the version
  of the weights that sampled each completion token, ``-1`` (:data:`~rollhub.experience.group.NOT_SAMPLED`) on
  prompt positions;
- ``scores``: the rewards; ``policy_version``: the version of the weights loaded when it was sampled (set by
  the manager), or, when the group has ``token_versions``, the oldest sampled token's version, so every staleness
  rule (they all read ``policy_version``) measures the oldest token;
- ``meta["group_overrides"]["rollhub"]`` (:func:`group_info`): ``env_name``, ``example_id``, ``correct`` (one
  flag per sequence), and once stamped by a manager ``worker_id`` and ``timestamp``. They travel inside the
  Atropos item, so a group read back from the buffer or a file carries them unchanged.

Aborted completions (``finish_reason == "abort"``: the server aborted the request, it failed, or it ended for a
reason rollhub does not know) are never scored and never trained on. A group environment passes what
``InferenceContext.complete`` returned through :func:`drop_aborted` before it scores anything: a prompt with an
aborted completion is left out whole, and :func:`make_group` refuses an aborted completion
(:class:`AbortedCompletionError`), so no group can carry one: an environment that skips :func:`drop_aborted`
fails on its first aborted completion instead of training on it. The whole prompt goes, not just the aborted
completion, because a group smaller than its environment's ``group_size`` is held by the buffer and merged with
other held groups of that environment until they add up to ``group_size``: the merged group would mix
completions of different prompts, and GRPO's advantages (each completion against its group's mean) would compare
answers to different questions. :class:`~rollhub.rollout.group.manager.GroupRolloutManager` counts the aborted
completions and the prompts they cost in every call's metrics (``aborted_completions``, ``aborted_groups``),
whatever the environment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from rollhub.errors import InvalidInput, RollhubError
from rollhub.experience import Group, Ragged
from rollhub.experience.episodes import episode_index, first_rows
from rollhub.experience.group import NOT_SAMPLED, PROMPT_LOGPROB, PROMPT_MASK
from rollhub.inference.base import Completion

INFO_KEY = "rollhub"

T = TypeVar("T")


class AbortedCompletionError(RollhubError):
    """A group was to be made from an aborted completion (see the module docstring)."""


def drop_aborted(
    examples: Sequence[T], completions: Sequence[Sequence[Completion]]
) -> tuple[list[tuple[T, list[Completion]]], int]:
    """The prompts whose completions all ended by ``"stop"`` or ``"length"``, ready to score.

    Args:
        examples: whatever identifies each prompt to the environment (the problem, its answer), in prompt order.
        completions: what ``InferenceContext.complete`` returned for those prompts, one list per prompt.

    Returns:
        ``(example, completions)`` for every prompt none of whose completions was aborted, in order, and the
        number of aborted completions among the prompts left out (their other completions are left out too;
        see the module docstring for why).
    """
    if len(examples) != len(completions):
        got = f"{len(examples)} examples but {len(completions)} completion lists"
        raise ValueError(f"drop_aborted got {got}; give one completion list per example")
    kept: list[tuple[T, list[Completion]]] = []
    aborted = 0
    for example, comps in zip(examples, completions, strict=True):
        n = sum(c.finish_reason == "abort" for c in comps)
        if n:
            aborted += n
        else:
            kept.append((example, list(comps)))
    return kept, aborted


def make_group(
    env_name: str, example_id: str, completions: Sequence[Completion], rewards: Sequence[float], correct: Sequence[bool]
) -> Group:
    """One group of the scored ``completions`` of one prompt (see the module docstring for the layout).

    When every completion carries ``versions``, the group gets ``token_versions`` and its ``policy_version`` is
    the oldest of them (:meth:`~rollhub.experience.Group.oldest_token_version`); otherwise neither is set here.

    Raises:
        AbortedCompletionError: a completion was aborted; leave its prompt out with :func:`drop_aborted`
            before scoring.
    """
    for i, c in enumerate(completions):
        if c.finish_reason == "abort":
            raise AbortedCompletionError(
                f"completion {i} of example {example_id!r} of {env_name!r} has finish_reason 'abort' and must not "
                "be scored or trained on; pass the completions through "
                "rollhub.envs.group.scored.drop_aborted before scoring",
                field="finish_reason",
                index=i,
            )
    tokens, masks, logprobs = [], [], []
    for c in completions:
        prompt, response = np.asarray(c.prompt_tokens, np.int32), np.asarray(c.tokens, np.int32)
        tokens.append(np.concatenate([prompt, response]))
        masks.append(np.concatenate([np.full(len(prompt), PROMPT_MASK, np.int32), response]))
        logprobs.append(np.concatenate([np.full(len(prompt), PROMPT_LOGPROB), np.asarray(c.logprobs, np.float64)]))
    info = {"env_name": env_name, "example_id": example_id, "correct": [bool(x) for x in correct]}
    meta: dict[str, Any] = {"group_overrides": {INFO_KEY: info}}
    if (params := sampled_with(completions)) is not None:
        meta["generation_params"] = params
    group = group_of_rows(tokens, masks, logprobs, rewards, meta)
    if completions and all(c.versions is not None for c in completions):
        group.token_versions = Ragged.from_rows(
            [np.concatenate([np.full(len(c.prompt_tokens), NOT_SAMPLED), np.asarray(c.versions, np.int64)])
             for c in completions], np.int64)  # fmt: skip
        group.policy_version = group.oldest_token_version()
    return group


def group_of_rows(
    tokens: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    logprobs: Sequence[np.ndarray],
    scores: Sequence[float],
    meta: dict[str, Any],
    policy_version: int | None = None,
) -> Group:
    """A group of per-row arrays: int32 tokens and masks, log-probs as float32 when that is exact (as the buffer
    stores them), else float64."""
    lp = Ragged.from_rows(list(logprobs), np.float64)
    narrow = lp.data.astype(np.float32)
    if np.array_equal(narrow, lp.data):
        lp = Ragged(narrow, lp.offsets)
    return Group(
        tokens=Ragged.from_rows(list(tokens), np.int32),
        masks=Ragged.from_rows(list(masks), np.int32),
        scores=np.asarray(scores, dtype=np.float64),
        inference_logprobs=lp,
        meta=meta,
        policy_version=policy_version,
    )


def sampled_with(completions: Sequence[Completion]) -> dict[str, Any] | None:
    """The ``generation_params`` of completions sampled with one setting (``None`` when the policy recorded none).

    Raises:
        InvalidInput: the completions of one group were sampled with different settings (a group must come from
            one distribution: the trainer reads one setting per group).
    """
    settings = {c.params for c in completions}
    if settings == {None} or not settings:
        return None
    if len(settings) > 1:
        raise InvalidInput(
            "the completions of one group were sampled with different settings; sample a group in one call",
            field="generation_params",
        )
    (params,) = settings
    return params.generation_params() if params is not None else None


def group_info(group: Group) -> dict[str, Any]:
    """The rollhub fields of a group (env name, example id, correct flags, worker id, timestamp); ``{}`` for
    groups from other producers."""
    overrides = group.meta.get("group_overrides") or {}
    info = overrides.get(INFO_KEY)
    return info if isinstance(info, dict) else {}


def stamp(group: Group, policy_version: int, worker_id: str, timestamp: float) -> Group:
    """Tag ``group`` (in place, and return it) with the loaded policy version, the worker and the time.

    A group with ``token_versions`` keeps the oldest sampled token's version as its ``policy_version`` instead of
    the loaded one, so its staleness is measured by its oldest token.
    """
    overrides = dict(group.meta.get("group_overrides") or {})
    overrides[INFO_KEY] = {**group_info(group), "worker_id": worker_id, "timestamp": timestamp}
    group.meta = {**group.meta, "group_overrides": overrides}
    oldest = group.oldest_token_version()
    group.policy_version = policy_version if oldest is None else oldest
    return group


def response_lengths(group: Group) -> np.ndarray:
    """Completion tokens of each sequence (positions whose mask is not :data:`PROMPT_MASK`)."""
    counted = np.concatenate([[0], np.cumsum(group.masks.data != PROMPT_MASK)])
    return counted[group.masks.offsets[1:]] - counted[group.masks.offsets[:-1]]


def correct_flags(group: Group) -> np.ndarray:
    """Whether each sequence's answer was exactly right (all False when the producer did not say)."""
    flags = group_info(group).get("correct") or [False] * group.size
    return np.asarray(flags, dtype=bool)


def _episode_firsts(group: Group) -> np.ndarray:
    """The row that stands for each sequence: every row, or the first row of each episode of a multi-turn group
    (its rows share the episode's score and flag, so counting rows would weigh a forked episode twice)."""
    index = episode_index(group)
    return np.arange(group.size) if index is None else first_rows(index)


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Summary of the groups one sampling call produced, for the curriculum and for logging.

    Attributes:
        lesson_id: the lesson sampled.
        n_sequences: sequences (completions) in the groups; for groups of multi-turn episodes, episodes (an
            episode a template rewrite forked into several rows counts once, here and in the two means below).
        mean_reward: mean score.
        accuracy: fraction of sequences marked correct.
        mean_response_tokens: mean completion length.
        informative_groups: fraction of groups whose scores differ (the ones GRPO learns from).
    """

    lesson_id: str
    n_sequences: int
    mean_reward: float
    accuracy: float
    mean_response_tokens: float
    informative_groups: float

    @classmethod
    def of(cls, groups: Sequence[Group], lesson_id: str = "") -> GroupStats:
        """Summarize ``groups`` (none gives zeros)."""
        if not groups:
            return cls(lesson_id, 0, 0.0, 0.0, 0.0, 0.0)
        firsts = [_episode_firsts(g) for g in groups]
        scores = np.concatenate([g.scores[f] for g, f in zip(groups, firsts, strict=True)])
        return cls(
            lesson_id=lesson_id,
            n_sequences=int(scores.size),
            mean_reward=float(scores.mean()),
            accuracy=float(np.concatenate([correct_flags(g)[f] for g, f in zip(groups, firsts, strict=True)]).mean()),
            mean_response_tokens=float(np.concatenate([response_lengths(g) for g in groups]).mean()),
            informative_groups=float(np.mean([np.ptp(g.scores) > 0 for g in groups])),
        )

    def metrics(self, prefix: str) -> dict[str, float]:
        """Flat numbers for a tracker, named ``{prefix}.{lesson_id}.{field}``."""
        p = f"{prefix}.{self.lesson_id}"
        return {
            f"{p}.accuracy": self.accuracy,
            f"{p}.mean_reward": self.mean_reward,
            f"{p}.n_sequences": float(self.n_sequences),
            f"{p}.mean_response_tokens": self.mean_response_tokens,
        }
