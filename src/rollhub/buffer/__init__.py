"""The experience buffer: core, batch formation, environment registry and storage backends."""

from rollhub.buffer.core import ExperienceBuffer
from rollhub.buffer.storage import Entry, MemoryStorage, Storage, make_storage
from rollhub.buffer.types import Batch, BufferConfig

__all__ = ["Batch", "BufferConfig", "Entry", "ExperienceBuffer", "MemoryStorage", "Storage", "make_storage"]
