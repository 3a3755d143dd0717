"""A rollout handler's settings, state, statistics, pause rule and metrics; its life (I/O) is in ``handler``."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from rollhub.client.env import to_group
from rollhub.client.errors import LifecycleError
from rollhub.client.retry import RetryEvent, RetryPolicy
from rollhub.client.trackers import Tracker, make_tracker
from rollhub.client.types import EnvRegistration, EnvStatus
from rollhub.errors import ConfigError
from rollhub.experience import Group

log = logging.getLogger("rollhub.client")

#: Longest retrying of the final ``/disconnect-env``: short, so a handler whose server is gone still exits.
DISCONNECT_GIVE_UP_S = 10.0
#: Pauses and resumes are logged at INFO at most this often (each one is logged at DEBUG).
NOTE_TRANSITIONS_EVERY_S = 60.0


class HandlerState(enum.Enum):
    """The lifecycle of a rollout handler.

    ``STARTING`` (registering, not producing) -> ``RUNNING`` (collecting and sending) <-> ``PAUSED``
    (generating nothing; the trainer is behind) -> ``STOPPED`` (disconnected, tracker finished).
    """

    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"


@dataclass
class HandlerStats:
    """Counters of one handler's life, readable while it runs.

    Attributes:
        groups_collected: groups returned by ``collect``.
        groups_sent / sequences_sent: groups (and their sequences) the server accepted.
        status_checks: ``/status-env`` reads.
        pauses / resumes: state changes made by the pause rule.
        sequences_since_check: sequences accepted since the last ``/status-env`` read (0 right after a read;
            a running handler reads the status again before its next group whenever this is not 0).
        retries: transient failures retried (connection errors, timeouts, 5xx).
        throttled: 429 answers waited out.
        registrations: successful ``/register-env`` calls (more than one after a server lost its data).
        last_queue_size: ``queue_size`` of the last status read, in this env's groups.
    """

    groups_collected: int = 0
    groups_sent: int = 0
    sequences_sent: int = 0
    status_checks: int = 0
    pauses: int = 0
    resumes: int = 0
    retries: int = 0
    throttled: int = 0
    registrations: int = 0
    last_queue_size: int | None = None
    sequences_since_check: int = 0


class TransitionNotes:
    """Logs pause/resume changes: at INFO at most once per ``every_s``, the others at DEBUG.

    A handler whose trainer keeps pace only just may pause and resume several times a second, each a real
    change; the INFO line then says how many changes happened since the previous INFO line.
    """

    def __init__(
        self, name: str, every_s: float = NOTE_TRANSITIONS_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        self.every_s = every_s
        self.clock = clock
        self._last_info: float | None = None
        self._unnoted = {"pause": 0, "resume": 0}

    def note(self, event: str, queued: int, threshold: float) -> bool:
        """Log one change (``"pause"`` or ``"resume"``); True when it was logged at INFO."""
        word, what = (">", "pausing") if event == "pause" else ("<=", "resuming")
        now = self.clock()
        if self._last_info is not None and now - self._last_info < self.every_s:
            self._unnoted[event] += 1
            log.debug("%s: %d queued sequences %s %g; %s", self.name, queued, word, threshold, what)
            return False
        earlier = ""
        if any(self._unnoted.values()):
            earlier = " ({pause} pauses and {resume} resumes since the last note)".format(**self._unnoted)
        log.info("%s: %d queued sequences %s %g; %s%s", self.name, queued, word, threshold, what, earlier)
        self._last_info = now
        self._unnoted = {"pause": 0, "resume": 0}
        return True


class HandlerCore:
    """Settings, state and bookkeeping of a rollout handler; its life (the I/O) lives in ``handler.HandlerLoop``.

    The arguments are documented on :class:`rollhub.client.RolloutHandler`.
    """

    def __init__(
        self,
        server_url: str,
        *,
        name: str,
        group_size: int,
        max_token_length: int,
        weight: float = 1.0,
        min_batch_allocation: float | None = None,
        off_policy_tolerance: float = 3,
        status_interval_s: float = 1.0,
        tracker: Tracker | str | None = None,
        api_key: str | None = None,
        retry: RetryPolicy | None = None,
        binary: bool | None = None,
    ) -> None:
        if group_size < 1:
            raise ConfigError(f"group_size is {group_size}; it must be at least 1")
        if off_policy_tolerance <= 0:
            raise ConfigError(f"off_policy_tolerance is {off_policy_tolerance}; it must be > 0")
        if status_interval_s <= 0:
            raise ConfigError(f"status_interval_s is {status_interval_s}; it must be > 0")
        self.server_url = server_url
        self.name = name
        self.group_size = group_size
        self.max_token_length = max_token_length
        self.weight = weight
        self.min_batch_allocation = min_batch_allocation
        self.off_policy_tolerance = off_policy_tolerance
        self.status_interval_s = status_interval_s
        self.tracker = make_tracker(tracker)
        self.retry_policy = retry or RetryPolicy()
        self._http_options: dict[str, Any] = {
            "api_key": api_key,
            "retry": self.retry_policy,
            "on_retry": self._on_retry,
        }
        self._binary = binary
        self.state = HandlerState.STARTING
        self.stats = HandlerStats()
        self.registration: EnvRegistration | None = None
        self.batch_size: int | None = None
        self.wandb_info: dict[str, Any] = {}
        self._metrics: dict[str, Any] = {}
        self._notes = TransitionNotes(name)
        self._status_tracked_at: float | None = None
        self._lock = threading.Lock()
        self._ran = False

    # ------------------------------------------------------------------ reading
    @property
    def env_id(self) -> int | None:
        """The env_id the server gave (None before registration)."""
        return None if self.registration is None else self.registration.env_id

    @property
    def wandb_name(self) -> str | None:
        """The unique W&B run name the server gave (None before registration)."""
        return None if self.registration is None else self.registration.wandb_name

    def log_metrics(self, metrics: dict[str, Any]) -> None:
        """Record env metrics (e.g. episode reward) from ``collect``; sent to the tracker with the next send.

        Names without a ``/`` are logged as ``env/<name>``.
        """
        with self._lock:
            for key, value in metrics.items():
                self._metrics[key if "/" in key else f"env/{key}"] = value

    def on_accepted(self, groups: list[Group]) -> None:
        """Called after the server accepted ``groups``; override to keep track of them (default: nothing)."""

    def _disconnect_options(self) -> dict[str, Any]:
        limit = self.retry_policy.give_up_after_s
        give_up = DISCONNECT_GIVE_UP_S if limit is None else min(limit, DISCONNECT_GIVE_UP_S)
        return {**self._http_options, "retry": replace(self.retry_policy, give_up_after_s=give_up)}

    # ----------------------------------------------------------- bookkeeping
    def _claim_run(self) -> None:
        with self._lock:
            if self._ran:
                raise LifecycleError(
                    f"handler {self.name!r} has already run (state {self.state.value}); "
                    "a handler runs once: create a new one to run again"
                )
            self._ran = True

    def _register_body(self) -> dict[str, Any]:
        return {
            "desired_name": self.name,
            "group_size": self.group_size,
            "max_token_length": self.max_token_length,
            "weight": self.weight,
            "min_batch_allocation": self.min_batch_allocation,
        }

    def _on_retry(self, event: RetryEvent) -> None:
        if event.kind == "throttled":
            self.stats.throttled += 1
        else:
            self.stats.retries += 1

    def _registered(self, registration: EnvRegistration, replaced: bool) -> None:
        self.registration = registration
        self.stats.registrations += 1
        if replaced:
            self.tracker.log({"event": "reregistered", "handler/env_id": registration.env_id})

    def _tracker_config(self) -> dict[str, Any]:
        return {
            "server_url": self.server_url,
            "desired_name": self.name,
            "env_id": self.env_id,
            "group_size": self.group_size,
            "max_token_length": self.max_token_length,
            "weight": self.weight,
            "min_batch_allocation": self.min_batch_allocation,
            "off_policy_tolerance": self.off_policy_tolerance,
            "batch_size": self.batch_size,
            "starting_step": None if self.registration is None else self.registration.starting_step,
        }

    def _start_tracker(self) -> None:
        assert self.registration is not None
        self.tracker.init(
            project=self.wandb_info.get("project"),
            group=self.wandb_info.get("group"),
            name=self.registration.wandb_name,
            config=self._tracker_config(),
        )

    @property
    def threshold(self) -> float:
        """Queued sequences above which the handler pauses: ``off_policy_tolerance * batch_size``."""
        return self.off_policy_tolerance * (self.batch_size or 0)

    def _status_due(self, now: float, next_check: float) -> bool:
        """Whether to read ``/status-env`` before the next group.

        Always after a send: every group a running handler sends follows a read, made after its previous
        send, that showed the queue at or under the threshold. So however many handlers share a queue, each
        adds at most one send (one ``collect`` result) beyond the threshold before it pauses. Otherwise (nothing
        sent, e.g. ``collect`` returned None, or paused) once per ``status_interval_s``.
        """
        return self.stats.sequences_since_check > 0 or now >= next_check

    def _apply_status(self, status: EnvStatus) -> None:
        """The pause rule: pause while queued sequences exceed the threshold, run otherwise."""
        self.stats.status_checks += 1
        self.stats.last_queue_size = status.queue_size
        self.stats.sequences_since_check = 0
        queued = status.queue_size * self.group_size
        over = queued > self.threshold
        event = None
        if over and self.state is HandlerState.RUNNING:
            self.state = HandlerState.PAUSED
            self.stats.pauses += 1
            event = "pause"
        elif not over and self.state is HandlerState.PAUSED:
            self.state = HandlerState.RUNNING
            self.stats.resumes += 1
            event = "resume"
        if event is not None:
            self._notes.note(event, queued, self.threshold)
        self._track_status(status, queued, event)

    def _track_status(self, status: EnvStatus, queued: int, event: str | None) -> None:
        """Status metrics go to the tracker on every change and otherwise at most once per status interval."""
        now = time.monotonic()
        last = self._status_tracked_at
        if event is None and last is not None and now - last < self.status_interval_s:
            return
        self._status_tracked_at = now
        metrics: dict[str, Any] = {
            "queue/size": status.queue_size,
            "queue/sequences": queued,
            "queue/threshold": self.threshold,
            "trainer/step": status.current_step,
            "handler/env_weight": status.env_weight,
            "handler/paused": int(self.state is HandlerState.PAUSED),
        }
        if event is not None:
            metrics["event"] = event
        self.tracker.log(metrics)

    def _prepare(self, result: Any) -> tuple[list[Group], bool]:
        """``collect``'s result as checked groups tagged with our env_id, and whether it was a list."""
        if result is None:
            return [], False
        as_list = isinstance(result, list | tuple)
        items = list(result) if as_list else [result]
        groups = [to_group(item, self.env_id) for item in items]
        self.stats.groups_collected += len(groups)
        return groups, as_list

    def _sent(self, groups: list[Group]) -> None:
        sequences = sum(g.size for g in groups)
        self.stats.groups_sent += len(groups)
        self.stats.sequences_sent += sequences
        self.stats.sequences_since_check += sequences
        with self._lock:
            metrics, self._metrics = self._metrics, {}
        metrics["env/score_mean"] = float(np.mean(np.concatenate([g.scores for g in groups])))
        metrics["handler/groups_sent"] = self.stats.groups_sent
        metrics["handler/sequences_sent"] = self.stats.sequences_sent
        self.tracker.log(metrics)
        self.on_accepted(groups)

    def _finish_tracker(self) -> None:
        try:
            self.tracker.log(
                {
                    "event": "stop",
                    **{f"handler/{k}": v for k, v in asdict(self.stats).items() if v is not None},
                }
            )
        finally:
            self.tracker.finish()
