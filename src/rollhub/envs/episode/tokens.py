"""The exact tokens of one episode: its rows, and per token the loss mask, behaviour log-prob and policy version.

:class:`EpisodeTokens` only ever appends. A model turn appends the ids the engine sampled, after checking that the
engine was prompted with exactly the row so far (:class:`TokenDriftError` otherwise: training on ids the engine
never saw would be training another policy's trajectory). Environment, tool and template tokens are appended as
rendered deltas (:mod:`rollhub.envs.episode.render`) with mask ``-100``; a fork starts a new row with the whole
re-rendered conversation, all ``-100``. Only sampled tokens ever train.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollhub.errors import RollhubError
from rollhub.experience.group import PROMPT_LOGPROB, PROMPT_MASK

if TYPE_CHECKING:
    from rollhub.inference.base import Completion

UNVERSIONED = -1


class TokenDriftError(RollhubError):
    """The engine was prompted with other ids than the row holds (so its sample continues another sequence)."""


@dataclass(slots=True)
class TokenRow:
    """One training row: ``tokens``, ``mask`` (the id where sampled, ``-100`` elsewhere), ``logprobs`` (behaviour
    log-prob where sampled, ``1.0`` elsewhere) and ``versions`` (policy version where sampled, ``-1`` elsewhere)."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def append_context(self, ids: Sequence[int]) -> None:
        """Append ids that are not trained (prompt, environment, tool and template tokens)."""
        self.tokens += ids
        self.mask += [PROMPT_MASK] * len(ids)
        self.logprobs += [PROMPT_LOGPROB] * len(ids)
        self.versions += [UNVERSIONED] * len(ids)

    def append_sampled(self, ids: Sequence[int], logprobs: Sequence[float], version: int | None,
                       versions: Sequence[int] | None = None) -> None:  # fmt: skip
        """Append ids the policy sampled, with their behaviour log-probs and the versions that sampled them: the
        engine's per-token ``versions`` when it reported them (a turn a weight push crossed holds two), else
        ``version`` for every id."""
        if len(ids) != len(logprobs):
            raise TokenDriftError(f"{len(ids)} sampled ids but {len(logprobs)} log-probs; need one per id")
        if versions is not None and len(versions) != len(ids):
            raise TokenDriftError(f"{len(ids)} sampled ids but {len(versions)} versions; need one per id")
        self.tokens += ids
        self.mask += ids
        self.logprobs += logprobs
        self.versions += (
            list(versions) if versions is not None else [UNVERSIONED if version is None else version] * len(ids)
        )

    def version_spans(self) -> list[list[int]]:
        """``[version, start, end)`` runs over the sampled positions (what a row record carries)."""
        spans: list[list[int]] = []
        for i, v in enumerate(self.versions):
            if v == UNVERSIONED:
                continue
            if spans and spans[-1][0] == v and spans[-1][2] == i:
                spans[-1][2] = i + 1
            else:
                spans.append([v, i, i + 1])
        return spans


class EpisodeTokens:
    """The rows of one episode; the last one is the row the next model turn continues.

    Args:
        prompt: the ids of the first prompt (the conversation rendered with the generation prompt).
    """

    def __init__(self, prompt: Sequence[int]) -> None:
        self.rows: list[TokenRow] = [TokenRow()]
        self.rows[0].append_context(prompt)

    @property
    def current(self) -> TokenRow:
        """The row the next model turn is prompted with."""
        return self.rows[-1]

    def sampled(self, completion: Completion, version: int | None) -> None:
        """Record a model turn: the engine's prompt ids (checked against the row) and its sampled ids with their
        log-probs, each with its version (the completion's per-token ``versions`` where the engine reported
        them, else ``version``).

        Raises:
            TokenDriftError: the engine's prompt ids are not the row's (it added or re-tokenized something), or
                it reported a version for other than every sampled id.
        """
        prompt = completion.prompt_tokens
        if list(prompt) != self.current.tokens:
            at = next((i for i, (a, b) in enumerate(zip(prompt, self.current.tokens, strict=False)) if a != b),
                      min(len(prompt), len(self.current.tokens)))  # fmt: skip
            raise TokenDriftError(
                f"the engine was prompted with {len(prompt)} ids but the row holds {len(self.current.tokens)}; "
                f"they first differ at position {at}. Send the row's ids as the prompt (a token-id prompt) and "
                "make sure the engine adds no special tokens to it"
            )
        self.current.append_sampled(completion.tokens, completion.logprobs, version, completion.versions)

    def environment(self, ids: Sequence[int]) -> None:
        """Append a rendered delta (not trained) to the current row."""
        self.current.append_context(ids)

    def fork(self, ids: Sequence[int]) -> None:
        """Start a new row holding ``ids`` (the re-rendered conversation; not trained)."""
        self.rows.append(TokenRow())
        self.current.append_context(ids)

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy sampled over the whole episode."""
        return sum(sum(m != PROMPT_MASK for m in r.mask) for r in self.rows)
