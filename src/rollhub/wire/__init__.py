"""Wire types: the Atropos request models, JSON items to :class:`~rollhub.experience.Group`, the binary codec,
and :func:`rollhub.wire.ingest.decode_groups`, the one decoder of ingest bodies (not imported here:
``rollhub.experience`` imports parts of this package)."""

from rollhub.wire.models import ITEM_KEYS, EnvIdentifier, RegisterEnv, Registration, ScoredData

__all__ = ["ITEM_KEYS", "EnvIdentifier", "RegisterEnv", "Registration", "ScoredData"]
