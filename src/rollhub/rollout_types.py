"""Group rollouts (the LLM case) and their exact conversion to and from the buffer server's items.

A :class:`Rollout` is one sampled completion of one prompt; a :class:`RolloutGroup` holds the completions
of one prompt (the unit that group-relative advantages compare and the buffer never splits); a
:class:`RolloutBatch` is what one ``sample_batch`` call produced. One group converts to one scored-data item:

- ``tokens``: prompt then completion; ``masks``: ``-100`` on prompt positions, the token id
  on completion ones;
- ``inference_logprobs``: ``1.0`` on prompt positions, the behaviour log-prob on completion ones;
- ``scores``: the episode rewards; ``policy_version``: the metadata's ``weight_step``;
- ``group_overrides["rollhub"]``: env name, example id, worker id and timestamp, so the round trip is exact.

This module sits outside the ``rollhub.rollout`` package on purpose: environments, trainers and writers use
these types without importing the rollout machinery (and Ray with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rollhub.errors import InvalidInput

PROMPT_MASK = -100
PROMPT_LOGPROB = 1.0
_META_KEY = "rollhub"


@dataclass(frozen=True, slots=True)
class RolloutMetadata:
    """Who produced a rollout, when, and with which weights.

    Attributes:
        worker_id: the producing worker.
        timestamp: Unix time at which the batch was produced.
        weight_step: trainer step of the weights that sampled it (the item's ``policy_version``).
    """

    worker_id: str
    timestamp: float
    weight_step: int


@dataclass(frozen=True, slots=True)
class Rollout:
    """One completion of one prompt, scored.

    Attributes:
        env_name: the environment (lesson) that produced it.
        env_example_id: the prompt's id within that environment (same for a whole group).
        prompt_tokens: prompt token ids exactly as the policy saw them.
        response_tokens: sampled completion token ids.
        response_logprobs: behaviour log-prob of each completion token.
        episode_reward: the scalar score.
        correct: whether the answer was right (what accuracy counts; rewards may give partial credit).
        metadata: producer, time and weight step; None until the manager attaches it.
    """

    env_name: str
    env_example_id: str
    prompt_tokens: tuple[int, ...]
    response_tokens: tuple[int, ...]
    response_logprobs: tuple[float, ...]
    episode_reward: float
    correct: bool = False
    metadata: RolloutMetadata | None = None

    def __post_init__(self) -> None:
        if len(self.response_logprobs) != len(self.response_tokens):
            raise InvalidInput(
                f"rollout {self.env_example_id!r} has {len(self.response_logprobs)} log-probs for "
                f"{len(self.response_tokens)} completion tokens; give one log-prob per token",
                field="response_logprobs",
            )

    def with_metadata(self, metadata: RolloutMetadata) -> Rollout:
        """A copy carrying ``metadata``."""
        return Rollout(
            self.env_name,
            self.env_example_id,
            self.prompt_tokens,
            self.response_tokens,
            self.response_logprobs,
            self.episode_reward,
            self.correct,
            metadata,
        )


@dataclass(frozen=True, slots=True)
class RolloutGroup:
    """The completions of one prompt, compared against each other by group-relative advantages."""

    rollouts: tuple[Rollout, ...]

    def __post_init__(self) -> None:
        if not self.rollouts:
            raise InvalidInput("a RolloutGroup needs at least one rollout", field="rollouts")

    @property
    def rewards(self) -> np.ndarray:
        """The episode rewards of the group, in rollout order."""
        return np.array([r.episode_reward for r in self.rollouts], dtype=np.float64)

    def to_item(self) -> dict[str, Any]:
        """The group as one scored-data item (see the module docstring for the layout)."""
        first = self.rollouts[0]
        for r in self.rollouts[1:]:
            if (r.env_name, r.env_example_id, r.metadata) != (
                first.env_name,
                first.env_example_id,
                first.metadata,
            ):
                raise InvalidInput(
                    f"group of example {first.env_example_id!r} mixes env names, example ids or metadata; "
                    "one group must come from one prompt and one sampling call",
                    field="rollouts",
                )
        meta: dict[str, Any] = {"env_name": first.env_name, "example_id": first.env_example_id}
        meta["correct"] = [bool(r.correct) for r in self.rollouts]
        if first.metadata is not None:
            meta["worker_id"] = first.metadata.worker_id
            meta["timestamp"] = first.metadata.timestamp
        item: dict[str, Any] = {
            "tokens": [[*r.prompt_tokens, *r.response_tokens] for r in self.rollouts],
            "masks": [[PROMPT_MASK] * len(r.prompt_tokens) + list(r.response_tokens) for r in self.rollouts],
            "scores": [float(r.episode_reward) for r in self.rollouts],
            "inference_logprobs": [
                [PROMPT_LOGPROB] * len(r.prompt_tokens) + list(r.response_logprobs) for r in self.rollouts
            ],
            "group_overrides": {_META_KEY: meta},
        }
        if first.metadata is not None:
            item["policy_version"] = first.metadata.weight_step
        return item

    @classmethod
    def from_item(cls, item: dict[str, Any]) -> RolloutGroup:
        """Rebuild a group from a scored-data item made by :meth:`to_item` (or any item with masks).

        The prompt of each sequence is its leading run of ``-100`` mask positions. Items from other
        producers (no ``group_overrides``) get empty names and no metadata.

        Raises:
            InvalidInput: masks or log-probs do not line up with tokens.
        """
        meta = (item.get("group_overrides") or {}).get(_META_KEY, {})
        metadata = None
        if item.get("policy_version") is not None and "worker_id" in meta:
            metadata = RolloutMetadata(meta["worker_id"], float(meta["timestamp"]), int(item["policy_version"]))
        logprobs = item.get("inference_logprobs")
        correct = meta.get("correct") or [False] * len(item["tokens"])
        rollouts = []
        for i, (toks, mask) in enumerate(zip(item["tokens"], item["masks"], strict=True)):
            toks, mask = [int(t) for t in toks], [int(m) for m in mask]
            if len(mask) != len(toks):
                raise InvalidInput(f"masks[{i}] is not as long as tokens[{i}]", field="masks", index=i)
            n_prompt = _prompt_length(mask)
            lps = [float(x) for x in logprobs[i]][n_prompt:] if logprobs else [0.0] * (len(toks) - n_prompt)
            rollouts.append(
                Rollout(
                    env_name=str(meta.get("env_name", "")),
                    env_example_id=str(meta.get("example_id", "")),
                    prompt_tokens=tuple(toks[:n_prompt]),
                    response_tokens=tuple(toks[n_prompt:]),
                    response_logprobs=tuple(lps),
                    episode_reward=float(item["scores"][i]),
                    correct=bool(correct[i]),
                    metadata=metadata,
                )
            )
        return cls(tuple(rollouts))


def _prompt_length(mask: list[int]) -> int:
    n = 0
    while n < len(mask) and mask[n] == PROMPT_MASK:
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class RolloutBatch:
    """The groups of one ``sample_batch`` call, all sharing ``metadata``."""

    groups: tuple[RolloutGroup, ...]
    metadata: RolloutMetadata
    lesson_id: str = ""

    def to_items(self) -> list[dict[str, Any]]:
        """One scored-data item per group."""
        return [g.to_item() for g in self.groups]

    @property
    def rollouts(self) -> list[Rollout]:
        """Every rollout of every group, flattened."""
        return [r for g in self.groups for r in g.rollouts]

    @classmethod
    def from_items(cls, items: list[dict[str, Any]], metadata: RolloutMetadata, lesson_id: str = "") -> RolloutBatch:
        """Rebuild a batch from its items (the inverse of :meth:`to_items`)."""
        return cls(groups=tuple(RolloutGroup.from_item(it) for it in items), metadata=metadata, lesson_id=lesson_id)


@dataclass(frozen=True, slots=True)
class RolloutBatchStats:
    """Summary of a batch for the curriculum and for logging.

    Attributes:
        lesson_id: the lesson sampled.
        n_rollouts: completions in the batch.
        mean_reward: mean episode reward.
        accuracy: fraction of completions marked correct.
        mean_response_tokens: mean completion length.
    """

    lesson_id: str
    n_rollouts: int
    mean_reward: float
    accuracy: float
    mean_response_tokens: float

    @classmethod
    def of(cls, batch: RolloutBatch, lesson_id: str) -> RolloutBatchStats:
        """Summarize ``batch`` (an empty batch gives zeros)."""
        rs = batch.rollouts
        n = max(len(rs), 1)
        return cls(
            lesson_id=lesson_id,
            n_rollouts=len(rs),
            mean_reward=sum(r.episode_reward for r in rs) / n,
            accuracy=sum(r.correct for r in rs) / n,
            mean_response_tokens=sum(len(r.response_tokens) for r in rs) / n,
        )
