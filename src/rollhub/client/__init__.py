"""Client libraries: the trainer client, the env client, the rollout-handler loop and trackers.

Writing an environment means subclassing :class:`RolloutHandler` (or :class:`AsyncRolloutHandler`) and
implementing ``collect()``; registration, W&B naming, sending, pausing, resuming, disconnecting and
surviving server restarts are done by ``run()``.
"""

from rollhub.client.env import AsyncEnvClient, EnvClient, to_group
from rollhub.client.errors import (
    DeliveryError,
    LifecycleError,
    PolicyVersionConflict,
    RequestRejected,
    ServerUnavailable,
    TrackerUnavailable,
)
from rollhub.client.handler import AsyncRolloutHandler, HandlerState, HandlerStats, RolloutHandler
from rollhub.client.retry import RetryEvent, RetryPolicy
from rollhub.client.session import EnvSession
from rollhub.client.trackers import JsonlTracker, NullTracker, Tracker, WandbTracker, make_tracker
from rollhub.client.trainer import AsyncTrainerClient, TrainerClient
from rollhub.client.types import Batch, EnvRegistration, EnvStatus, PublishedVersion, QueueStatus, ServerInfo

__all__ = [
    "AsyncEnvClient",
    "AsyncRolloutHandler",
    "AsyncTrainerClient",
    "Batch",
    "DeliveryError",
    "EnvClient",
    "EnvRegistration",
    "EnvSession",
    "EnvStatus",
    "HandlerState",
    "HandlerStats",
    "JsonlTracker",
    "LifecycleError",
    "NullTracker",
    "PolicyVersionConflict",
    "PublishedVersion",
    "QueueStatus",
    "RequestRejected",
    "RetryEvent",
    "RetryPolicy",
    "RolloutHandler",
    "ServerInfo",
    "ServerUnavailable",
    "Tracker",
    "TrackerUnavailable",
    "TrainerClient",
    "WandbTracker",
    "make_tracker",
    "to_group",
]
