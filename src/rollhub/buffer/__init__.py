"""The experience buffer: the coordinating core and its parts (queue, batch former, staleness clock,
admission, env registry) over one storage backend."""

from rollhub.buffer.batching import BatchFormer
from rollhub.buffer.core import ExperienceBuffer
from rollhub.buffer.results import BufferStatus, EnvRegistration, EnvStatus, Ingested, VersionPublished
from rollhub.buffer.storage import Entry, MemoryStorage, Storage, make_storage
from rollhub.buffer.types import Batch, BufferConfig, TrainerRun

__all__ = [
    "Batch",
    "BatchFormer",
    "BufferConfig",
    "BufferStatus",
    "Entry",
    "EnvRegistration",
    "EnvStatus",
    "ExperienceBuffer",
    "Ingested",
    "MemoryStorage",
    "Storage",
    "TrainerRun",
    "VersionPublished",
    "make_storage",
]
