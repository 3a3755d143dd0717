"""One gateway session: the episode an agent's calls make, recorded with exact tokens.

Every call is planned, sent, then recorded, so a call that fails changes nothing:

1. :meth:`Session.plan_chat` / :meth:`Session.plan_completion` work out the prompt ids without touching the row.
   A chat call whose messages continue the recorded conversation (:func:`~rollhub.gateway.chat.matched_prefix`)
   appends the new messages as a rendered delta onto the row (:meth:`~rollhub.envs.episode.render.ChatRenderer.
   extend`); one that does not (the agent cut or edited its history, changed its tools), or a template that rewrote
   history, starts a new row. A completions call whose prompt ids extend the row appends the rest; any other
   prompt starts a new row. A prompt that leaves no room in the episode's budget is refused
   (:class:`BudgetExceeded`), and the episode is flagged truncated.
2. The engine samples from exactly those ids.
3. :meth:`Session.record` checks the engine's prompt ids against the plan and appends the sampled ids with their
   log-probs and the policy version.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rollhub.envs.episode.episode import Episode
from rollhub.envs.episode.render import ChatRenderer
from rollhub.envs.episode.tokens import EpisodeTokens
from rollhub.envs.episode.types import Finish, Outcome, Task
from rollhub.errors import RollhubError
from rollhub.gateway.chat import assistant_message, matched_prefix, template_message
from rollhub.inference.base import Completion

SessionState = Literal["open", "finished", "abandoned"]


class GatewayError(RollhubError):
    """A gateway request that cannot be served (see the subclasses for the HTTP status each gets)."""


class UnknownSession(GatewayError):
    """No session has this id (404)."""


class SessionClosed(GatewayError):
    """The session was finished or abandoned (409)."""


class SessionBusy(GatewayError):
    """Another call of the same session is still running (409): an episode's turns are sequential."""


class BudgetExceeded(GatewayError):
    """The request's prompt leaves no room in the episode's token budget (400)."""


class UnknownModel(GatewayError):
    """The request names a model this gateway does not serve (404)."""


class BadRequest(GatewayError):
    """A request the gateway does not support or that is inconsistent (400)."""


class EngineFailed(GatewayError):
    """The engine failed or aborted the request (502); nothing was recorded."""


class SinkFailed(GatewayError):
    """A finished group could not be handed to the sink (503); the group is lost and counted."""


@dataclass(frozen=True, slots=True)
class Plan:
    """The prompt of one call, worked out before it is sent.

    Attributes:
        ids: the whole prompt (the row the engine continues).
        kind: ``"start"`` (the episode's first row), ``"append"`` (``ids`` extends the row), ``"fork"`` (a new row).
        reason: why it forked.
        conversation: the recorded conversation after the call's messages (``None``: a completions call).
        rendered: the same as the template renders it.
        cap: the most tokens the turn may sample (what is left of the budget, at most the request's ``max_tokens``).
        cut_by: what ``cap`` came from (``"length"``: the request's cap; ``"budget"``: the episode's budget).
    """

    ids: tuple[int, ...]
    kind: Literal["start", "append", "fork"]
    reason: str
    conversation: tuple[dict[str, Any], ...] | None
    rendered: tuple[dict[str, Any], ...] | None
    cap: int
    cut_by: Finish


class Session:
    """One agent episode (see the module docstring).

    Args:
        session_id: its id (also its episode's id).
        group: the key of the group of sessions it belongs to (its task).
        engine: the index of the engine it is pinned to.
        max_tokens: the episode's token budget.
        metadata: what the agent gave at creation (the scorer reads it as the task's ``data``).
        now: the creation time.
    """

    def __init__(self, session_id: str, group: str, engine: int, max_tokens: int, metadata: Mapping[str, Any],
                 now: float) -> None:  # fmt: skip
        self.id = session_id
        self.group = group
        self.engine = engine
        self.max_tokens = max_tokens
        self.metadata = dict(metadata)
        self.state: SessionState = "open"
        self.last_seen = now
        self.lock = threading.Lock()
        self.episode: Episode | None = None
        self.tools: list[dict[str, Any]] | None = None
        self.conversation: tuple[dict[str, Any], ...] | None = None
        self.rendered: tuple[dict[str, Any], ...] = ()
        self.stop_token: int | None = None
        self.cut: Finish | None = None
        self.posted: Outcome | None = None
        self.turn_rewards: list[float] | None = None
        self.summary: dict[str, Any] | None = None

    @property
    def row(self) -> list[int]:
        """The row the next call continues (empty before the first call)."""
        return self.episode.tokens.current.tokens if self.episode is not None else []

    def plan_chat(self, renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None, max_tokens: int) -> Plan:  # fmt: skip
        """The prompt of a chat call (see the module docstring); nothing changes until :meth:`record`."""
        sent = tuple(dict(m) for m in messages)
        as_template = tuple(template_message(m) for m in sent)
        tool_list = [dict(t) for t in tools] if tools else None
        if self.episode is None:
            return self._plan(renderer.prompt(as_template, tool_list), "start", "", sent, as_template, max_tokens)
        if tool_list != self.tools:
            reason = "the agent changed its tools"
        elif self.conversation is None or not matched_prefix(self.conversation, sent):
            reason = "the agent's messages do not continue the session's conversation"
        else:
            new = as_template[len(self.conversation) :]
            ext = renderer.extend(self.rendered, new, tool_list, self.stop_token)
            if not ext.forked:
                return self._plan([*self.row, *ext.ids], "append", "", sent, (*self.rendered, *new), max_tokens)
            reason = ext.reason
        return self._plan(renderer.prompt(as_template, tool_list), "fork", reason, sent, as_template, max_tokens)

    def plan_completion(self, renderer: ChatRenderer, prompt: str | Sequence[int], max_tokens: int) -> Plan:
        """The prompt of a completions call: text is encoded as an engine encodes it; ids are taken as they are."""
        ids = renderer.encode(prompt, renderer.add_special_tokens) if isinstance(prompt, str) else list(prompt)
        if self.episode is None:
            return self._plan(ids, "start", "", None, None, max_tokens)
        row = self.row
        if ids[: len(row)] == row:
            return self._plan(ids, "append", "", None, None, max_tokens)
        return self._plan(ids, "fork", "the prompt does not continue the session's row", None, None, max_tokens)

    def _plan(self, ids: Sequence[int], kind: Literal["start", "append", "fork"], reason: str,
              conversation: tuple[dict[str, Any], ...] | None, rendered: tuple[dict[str, Any], ...] | None,
              max_tokens: int) -> Plan:  # fmt: skip
        room = self.max_tokens - len(ids)
        if room <= 0:
            self.cut = "budget"
            raise BudgetExceeded(
                f"this request's prompt is {len(ids)} tokens and session {self.id}'s episode budget is "
                f"{self.max_tokens}: nothing is left to sample. Finish the session (POST .../finish with its reward)"
            )
        cut_by: Finish = "length" if max_tokens <= room else "budget"
        return Plan(tuple(ids), kind, reason, conversation, rendered, min(max_tokens, room), cut_by)

    def record(self, plan: Plan, completion: Completion, tools: Sequence[Mapping[str, Any]] | None,
               version: int | None) -> dict[str, Any]:  # fmt: skip
        """Record a sampled turn (see the module docstring); returns the assistant message the agent gets.

        Raises:
            TokenDriftError: the engine was prompted with other ids than planned (nothing is recorded).
        """
        ids = list(plan.ids)
        if self.episode is None:
            task = Task(self.group, plan.rendered or (), tuple(tools or ()), self.metadata)
            self.episode = Episode(task, self.id, EpisodeTokens(ids), [])
        elif plan.kind == "fork":
            self.episode.tokens.fork(ids)
            self.episode.forks.append(plan.reason)
        else:
            self.episode.tokens.environment(ids[len(self.row) :])
        self.episode.tokens.sampled(completion, version)
        self.episode.turn_rewards.append(0.0)
        self.tools = [dict(t) for t in tools] if tools else None
        message, _ = assistant_message(completion.text, self.episode.turns - 1)
        sampled = {"role": "assistant", "content": completion.text}
        if plan.conversation is not None and plan.rendered is not None:
            self.conversation = (*plan.conversation, message)
            self.rendered = (*plan.rendered, sampled)
            self.episode.messages = [dict(m) for m in self.rendered]
        else:  # a completions call: no conversation to continue; its turns are kept as assistant messages
            self.conversation = None
            self.episode.messages.append(sampled)
        self.stop_token = completion.tokens[-1] if completion.finish_reason == "stop" and completion.tokens else None
        if completion.finish_reason == "length":
            self.cut = plan.cut_by
        return message

    def end(self, state: SessionState, outcome: Outcome | None) -> None:
        """Close the session: its episode ends ``done`` (finished), ``abandoned``, or as it was cut."""
        self.state = state
        if self.episode is not None:
            self.episode.finish = self.cut or ("done" if state == "finished" else "abandoned")
            self.episode.outcome = outcome
            if self.turn_rewards is not None:
                self.episode.turn_rewards = list(self.turn_rewards)

    def release(self) -> None:
        """Keep only the summary (:meth:`info`) once the episode has gone into its group (or was dropped)."""
        self.summary = self.info()
        self.episode = None
        self.conversation, self.rendered = None, ()

    def info(self) -> dict[str, Any]:
        """What ``GET /sessions/{id}`` answers."""
        if self.summary is not None:
            return {**self.summary, "state": self.state}
        ep = self.episode
        return {
            "session_id": self.id, "group": self.group, "state": self.state, "engine": self.engine,
            "turns": ep.turns if ep else 0, "rows": len(ep.tokens.rows) if ep else 0,
            "tokens": len(self.row), "max_tokens": self.max_tokens, "truncated": self.cut is not None,
            "sampled_tokens": ep.tokens.sampled_tokens if ep else 0,
        }  # fmt: skip
