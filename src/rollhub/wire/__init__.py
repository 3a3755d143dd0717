"""Wire types: the Atropos request models, JSON items to and from :class:`~rollhub.experience.Group`
(:mod:`rollhub.wire.group`), the binary codec, and :func:`rollhub.wire.ingest.decode_groups`, the one decoder of
ingest bodies. Every encoding and decoding of the experience types lives here; ``rollhub.experience`` imports
nothing of it."""

from rollhub.wire.models import ITEM_KEYS, EnvIdentifier, RegisterEnv, Registration, ScoredData

__all__ = ["ITEM_KEYS", "EnvIdentifier", "RegisterEnv", "Registration", "ScoredData"]
