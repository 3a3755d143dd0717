"""The capture gateway's core (no HTTP): sessions pinned to engines, exact tokens per call, episodes out as groups.

An agent written against the OpenAI client trains by pointing its ``base_url`` at a session
(``/sessions/{id}/v1``): each call's prompt and sampled ids are recorded (:mod:`rollhub.gateway.session`), and a
finished session becomes an episode of the group its ``group`` key names. When all ``group_size`` sessions of a
group have ended, the group goes to the sink (a buffer writer, an in-process queue) as one
:class:`~rollhub.experience.Group`, laid out as :func:`~rollhub.envs.episode.episode.episodes_to_group` lays out any
group of episodes.

**Rewards.** The agent posts its episode's reward (``finish`` with a reward, or ``reward`` then ``finish``), or the
gateway's ``scorer`` (an environment's ``outcome(task, episode)``; the task's ``data`` is the session's metadata)
judges it when the agent posts none.

**Partial episodes.** A session that ends without ``finish`` (the agent called ``DELETE``, or sent nothing for
``idle_timeout_s``) is *abandoned*. Everything it recorded stays recorded: a disconnect never loses a sampled turn
(a call is recorded when the engine answers, whether or not the agent is still there to read the answer). An
abandoned session is kept, as an episode flagged truncated (``finish = "abandoned"``), when it has at least one
model turn and a reward is known (posted before it went away, or given by the scorer); otherwise it is dropped. A
group is sent only when every one of its sessions was kept, so GRPO never compares an episode against a group
missing some of its members (the rule single-turn groups follow for an aborted completion); a dropped session drops
its group, and both are counted.

**Sampling.** Every turn is drawn with the gateway's ``sampling`` settings whatever the agent asks (its temperature
and the like are ignored): the trainer must know the distribution each token was drawn from. ``max_tokens`` of a
request is kept, within what is left of the episode's budget.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollhub.envs.episode.episode import Episode, episodes_to_group
from rollhub.envs.episode.render import ChatRenderer
from rollhub.envs.episode.runner import TokenPolicy
from rollhub.envs.episode.types import Outcome, Task
from rollhub.errors import RollhubError
from rollhub.experience import Group
from rollhub.gateway.chat import chat_response, completion_response
from rollhub.gateway.session import (
    BadRequest,
    BudgetExceeded,
    EngineFailed,
    Plan,
    Session,
    SessionBusy,
    SessionClosed,
    SinkFailed,
    UnknownModel,
    UnknownSession,
)
from rollhub.inference.base import Completion, SamplingParams

Scorer = Callable[[Task, Episode], Outcome]


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The gateway's settings.

    Attributes:
        model: the model name the gateway serves (requests naming another get 404).
        max_tokens: a session's default episode token budget.
        turn_max_tokens: a call's ``max_tokens`` when the request gives none.
        sampling: the settings every turn is drawn with (``max_tokens`` is set per call).
        idle_timeout_s: a session with no request for this long is abandoned.
        discount: the per-turn discount of an episode's score (turn rewards come with ``finish``).
        env_name: written into the groups as their environment's name.
    """

    model: str
    max_tokens: int = 4096
    turn_max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    idle_timeout_s: float = 600.0
    discount: float = 1.0
    env_name: str = "gateway"


@dataclass
class _Slot:
    """The sessions of one group key so far."""

    size: int
    sessions: list[Session] = field(default_factory=list)


class Gateway:
    """Sessions, engines and groups (see the module docstring). A session whose group was sent or dropped keeps only
    its summary; the last :attr:`MAX_ENDED` of them answer ``409`` (ended) rather than ``404`` (unknown).

    Args:
        engines: one policy per engine (``OpenAICompletionsClient`` for a vLLM server); a session is pinned to the
            one with the fewest open sessions when it is created.
        renderer: the served model's chat template.
        config: the settings.
        sink: receives each complete group (``[group]``).
        scorer: judges a session whose agent posted no reward (``None``: the agent must post one).
        clock: the time source (tests pass their own to abandon idle sessions).
    """

    MAX_ENDED = 10_000

    def __init__(self, engines: Sequence[TokenPolicy], renderer: ChatRenderer, config: GatewayConfig,
                 sink: Callable[[list[Group]], None], scorer: Scorer | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not engines:
            raise BadRequest("a gateway needs at least one engine")
        self.engines = list(engines)
        self.renderer = renderer
        self.config = config
        self.sink = sink
        self.scorer = scorer
        self.clock = clock
        self.policy_version: int | None = None
        self._sessions: dict[str, Session] = {}
        self._slots: dict[str, _Slot] = {}
        self._ended: deque[str] = deque()  # ids of released sessions, oldest first (forgotten past MAX_ENDED)
        self._lock = threading.Lock()
        self._rng = np.random.default_rng()
        names = ("sessions", "finished", "abandoned", "kept", "dropped", "groups_sent", "groups_dropped",
                 "groups_failed", "calls", "forks", "refused_budget")  # fmt: skip
        self.counts = dict.fromkeys(names, 0)

    # ------------------------------------------------------------------ sessions
    def open(self, group: str | None = None, group_size: int = 1, max_tokens: int | None = None,
             metadata: Mapping[str, Any] | None = None) -> Session:  # fmt: skip
        """Open a session in group ``group`` (a new group of its own when ``None``) of ``group_size`` sessions."""
        if group_size < 1 or (max_tokens is not None and max_tokens < 2):
            raise BadRequest(f"group_size {group_size} must be >= 1 and max_tokens {max_tokens} >= 2")
        session_id = uuid.uuid4().hex
        key = group if group is not None else session_id
        with self._lock:
            slot = self._slots.setdefault(key, _Slot(group_size))
            if slot.size != group_size:
                raise BadRequest(f"group {key!r} was opened with group_size {slot.size}, not {group_size}")
            if len(slot.sessions) >= slot.size:
                raise SessionClosed(f"group {key!r} already has its {slot.size} sessions; use another group key")
            busy = [0] * len(self.engines)
            for s in self._sessions.values():
                busy[s.engine] += s.state == "open"
            engine = busy.index(min(busy))
            session = Session(session_id, key, engine, max_tokens or self.config.max_tokens, metadata or {},
                              self.clock())  # fmt: skip
            self._sessions[session_id] = session
            slot.sessions.append(session)
            self.counts["sessions"] += 1
        return session

    def session(self, session_id: str, *, open_only: bool = True) -> Session:
        """The session ``session_id`` (raises :class:`UnknownSession`, or :class:`SessionClosed` when it ended)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSession(f"no session {session_id!r}; open one with POST /sessions")
        if open_only and session.state != "open":
            raise SessionClosed(f"session {session_id!r} is {session.state}; open a new session for a new episode")
        return session

    # ------------------------------------------------------------------ calls
    def chat(self, session_id: str, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
             model: str | None = None, max_tokens: int | None = None) -> dict[str, Any]:  # fmt: skip
        """Serve one ``/v1/chat/completions`` call of a session; returns the ``chat.completion`` object."""
        if not messages:
            raise BadRequest("messages is empty; send the conversation")
        return self._call(session_id, model, lambda s, cap: s.plan_chat(self.renderer, messages, tools, cap),
                          lambda plan, c, turn: chat_response(self.config.model, c, turn, len(plan.ids)),
                          tools, max_tokens)  # fmt: skip

    def complete(self, session_id: str, prompt: str | Sequence[int], model: str | None = None,
                 max_tokens: int | None = None) -> dict[str, Any]:  # fmt: skip
        """Serve one ``/v1/completions`` call of a session; returns the ``text_completion`` object."""
        return self._call(session_id, model, lambda s, cap: s.plan_completion(self.renderer, prompt, cap),
                          lambda plan, c, turn: completion_response(self.config.model, c, len(plan.ids)),
                          None, max_tokens)  # fmt: skip

    def _call(self, session_id: str, model: str | None, plan_of: Callable[[Session, int], Plan],
              answer: Callable[[Plan, Completion, int], dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
              max_tokens: int | None) -> dict[str, Any]:  # fmt: skip
        if model is not None and model != self.config.model:
            raise UnknownModel(f"model {model!r} is not served here; this gateway serves {self.config.model!r}")
        session = self.session(session_id)
        if not session.lock.acquire(blocking=False):
            raise SessionBusy(f"session {session_id!r} has a call running; an episode's turns are sequential")
        try:
            session.last_seen = self.clock()
            try:
                plan = plan_of(session, max_tokens or self.config.turn_max_tokens)
            except BudgetExceeded:
                self.counts["refused_budget"] += 1
                raise
            params = dataclasses.replace(self.config.sampling, max_tokens=plan.cap)
            engine = self.engines[session.engine]
            try:
                (completion,) = engine.complete([list(plan.ids)], 1, params, self._rng)[0]
            except RollhubError as exc:
                raise EngineFailed(f"engine {session.engine} failed: {exc}") from None
            if completion.finish_reason == "abort":
                raise EngineFailed(f"engine {session.engine} aborted the request; nothing was recorded, retry it")
            session.record(plan, completion, tools, self.policy_version)  # recorded even if the agent has gone
            self.counts["calls"] += 1
            self.counts["forks"] += plan.kind == "fork"
            session.last_seen = self.clock()
            assert session.episode is not None
            return answer(plan, completion, session.episode.turns - 1)
        finally:
            session.lock.release()

    # ------------------------------------------------------------------ ends
    def post_reward(self, session_id: str, reward: float, correct: bool = False,
                    turn_rewards: Sequence[float] | None = None) -> None:  # fmt: skip
        """Set the session's reward (and optionally one reward per model turn) before it ends."""
        session = self.session(session_id)
        turns = session.episode.turns if session.episode is not None else 0
        if turn_rewards is not None and len(turn_rewards) != turns:
            raise BadRequest(f"turn_rewards has {len(turn_rewards)} values but the session has {turns} turns")
        session.posted = Outcome(float(reward), bool(correct))
        session.turn_rewards = list(map(float, turn_rewards)) if turn_rewards is not None else None
        session.last_seen = self.clock()

    def finish(self, session_id: str, reward: float | None = None, correct: bool = False,
               turn_rewards: Sequence[float] | None = None) -> dict[str, Any]:  # fmt: skip
        """End the session's episode with its reward (posted now, before, or by the scorer)."""
        session = self.session(session_id)
        if reward is not None:
            self.post_reward(session_id, reward, correct, turn_rewards)
        if session.episode is None:
            raise BadRequest(f"session {session_id!r} has no model turn yet; an episode needs at least one")
        outcome = session.posted or self._score(session)
        if outcome is None:
            raise BadRequest("no reward: post one with the finish request (reward=...), or give the gateway a scorer")
        self._end(session, "finished", outcome)
        return session.info()

    def abandon(self, session_id: str) -> dict[str, Any]:
        """End the session without ``finish`` (the agent went away); see the partial-episode rule."""
        session = self.session(session_id)
        self._end(session, "abandoned", session.posted or self._score(session))
        return session.info()

    def reap(self) -> int:
        """Abandon every open session idle for ``idle_timeout_s``; returns how many."""
        now = self.clock()
        with self._lock:
            idle = [s for s in self._sessions.values()
                    if s.state == "open" and now - s.last_seen >= self.config.idle_timeout_s]  # fmt: skip
        for session in idle:
            if session.lock.acquire(blocking=False):  # a session with a call running is not idle
                try:
                    self._end(session, "abandoned", session.posted or self._score(session))
                finally:
                    session.lock.release()
        return len(idle)

    def _score(self, session: Session) -> Outcome | None:
        if self.scorer is None or session.episode is None:
            return None
        return self.scorer(session.episode.task, session.episode)

    def _end(self, session: Session, state: str, outcome: Outcome | None) -> None:
        with self._lock:
            if session.state != "open":
                return
            session.end(state, outcome)  # type: ignore[arg-type]
            self.counts[state] += 1
            slot = self._slots[session.group]
            if len(slot.sessions) < slot.size or any(s.state == "open" for s in slot.sessions):
                return
            del self._slots[session.group]
        self._send(slot)

    def _send(self, slot: _Slot) -> None:
        kept = [s for s in slot.sessions if s.episode is not None and s.episode.turns and s.episode.outcome]
        self.counts["kept"] += len(kept)
        self.counts["dropped"] += len(slot.sessions) - len(kept)
        try:
            if len(kept) < len(slot.sessions):
                self.counts["groups_dropped"] += 1
                return
            params = self.config.sampling.generation_params() | {"max_tokens": self.config.turn_max_tokens}
            episodes = [s.episode for s in kept if s.episode is not None]
            group = episodes_to_group(self.config.env_name, episodes, self.config.discount, params)
            try:
                self.sink([group])
            except Exception as exc:  # the writer's own retries are spent: say so to the agent ending the group
                self.counts["groups_failed"] += 1
                raise SinkFailed(f"the group of {len(episodes)} episodes could not be written: {exc}") from exc
            self.counts["groups_sent"] += 1
        finally:
            with self._lock:
                for s in slot.sessions:
                    s.release()
                    self._ended.append(s.id)
                while len(self._ended) > self.MAX_ENDED:
                    self._sessions.pop(self._ended.popleft(), None)

    def status(self) -> dict[str, Any]:
        """Counts (sessions, finished, abandoned, kept, dropped, groups sent and dropped, calls, forks, budget
        refusals), open sessions per engine and the policy version."""
        with self._lock:
            per_engine = [0] * len(self.engines)
            for s in self._sessions.values():
                per_engine[s.engine] += s.state == "open"
        return {**self.counts, "open_per_engine": per_engine, "policy_version": self.policy_version}
