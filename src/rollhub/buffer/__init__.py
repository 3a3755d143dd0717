"""The experience buffer: one table (:mod:`rollhub.buffer.table`) with injected storage, batch rule, staleness gate
and admission; the Atropos buffer (:class:`ExperienceBuffer`) is that table with AtroposLib's batch rule and an env
registry."""

from rollhub.buffer.atropos import ExperienceBuffer
from rollhub.buffer.backends import make_storage
from rollhub.buffer.batching import BatchFormer, FragmentRule, PackingRule
from rollhub.buffer.envs import EnvRegistration, EnvRequest, EnvStatus
from rollhub.buffer.results import BufferStatus, Ingested, VersionPublished
from rollhub.buffer.storage import Codec, Entry, MemoryStorage, Storage
from rollhub.buffer.table import Admission, BatchRule, StalenessGate, Table
from rollhub.buffer.types import Batch, BufferConfig, TrainerRun

__all__ = [
    "Admission",
    "Batch",
    "BatchFormer",
    "BatchRule",
    "BufferConfig",
    "BufferStatus",
    "Codec",
    "Entry",
    "EnvRegistration",
    "EnvRequest",
    "EnvStatus",
    "ExperienceBuffer",
    "FragmentRule",
    "Ingested",
    "MemoryStorage",
    "PackingRule",
    "StalenessGate",
    "Storage",
    "Table",
    "TrainerRun",
    "VersionPublished",
    "make_storage",
]
