"""Wire types: the Atropos request models, JSON items to :class:`~rollhub.experience.Group`, and the binary codec."""

from rollhub.wire.models import ITEM_KEYS, EnvIdentifier, RegisterEnv, Registration, ScoredData

__all__ = ["ITEM_KEYS", "EnvIdentifier", "RegisterEnv", "Registration", "ScoredData"]
