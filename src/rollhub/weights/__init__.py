"""Versioned policy weights from the trainer to the rollout side: publisher/subscriber plus transports."""

from __future__ import annotations

from rollhub.weights.base import FanOutPublisher, WeightPublisher, WeightSubscriber, WeightUpdate

__all__ = ["FanOutPublisher", "WeightPublisher", "WeightSubscriber", "WeightUpdate"]
