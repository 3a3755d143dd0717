"""Fakes shared by the training tests (``tests.train`` and ``tests.run``)."""

from __future__ import annotations

from typing import Any

from rollhub.experience import SampleFragment


class RecordingSource:
    """A trainer's source that records each batch it hands out and the trainer version it was handed out at.

    Args:
        inner: the source it passes through (``next_batch(wait_s)`` and ``publish_version(version)``).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.version = -1
        self.handed: list[tuple[int, list[SampleFragment]]] = []

    def next_batch(self, wait_s: float) -> list[SampleFragment] | None:
        batch = self.inner.next_batch(wait_s)
        if batch:
            self.handed.append((self.version, batch))
        return batch

    def publish_version(self, version: int) -> None:
        self.version = version
        self.inner.publish_version(version)
