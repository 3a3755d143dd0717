"""Versioned policy weights from the trainer to the rollout side: publisher/subscriber plus transports."""

from __future__ import annotations

from rollhub.weights.base import WeightPublisher, WeightSubscriber, WeightUpdate

__all__ = ["WeightPublisher", "WeightSubscriber", "WeightUpdate"]
