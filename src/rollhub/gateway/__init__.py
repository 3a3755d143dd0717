"""The capture gateway: an OpenAI-compatible endpoint per session in front of the engines, recording exact tokens
and turning finished sessions into groups of episodes (:mod:`rollhub.gateway.core`; HTTP: :mod:`rollhub.gateway.app`).
"""

from __future__ import annotations

from rollhub.gateway.core import Gateway, GatewayConfig
from rollhub.gateway.session import (
    BadRequest,
    BudgetExceeded,
    EngineFailed,
    GatewayError,
    Session,
    SessionBusy,
    SessionClosed,
    SinkFailed,
    UnknownModel,
    UnknownSession,
)

__all__ = [
    "BadRequest",
    "BudgetExceeded",
    "EngineFailed",
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "Session",
    "SessionBusy",
    "SessionClosed",
    "SinkFailed",
    "UnknownModel",
    "UnknownSession",
]
