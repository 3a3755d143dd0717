"""Wire types: the Atropos request models, the compact :class:`Group`, and the binary codec."""

from rollhub.wire.group import Group, Ragged, group_from_json
from rollhub.wire.models import ITEM_KEYS, EnvIdentifier, RegisterEnv, Registration, ScoredData

__all__ = [
    "ITEM_KEYS",
    "EnvIdentifier",
    "Group",
    "Ragged",
    "RegisterEnv",
    "Registration",
    "ScoredData",
    "group_from_json",
]
