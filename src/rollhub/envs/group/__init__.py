"""Group environments (the LLM case): the protocol, the base of prompt-per-group environments, built-in
environments and the spec loader."""

from __future__ import annotations

from rollhub.envs.group.base import GroupEnv, Mode
from rollhub.envs.group.prompted import PromptedEnv
from rollhub.envs.group.spec import BUILTIN_SPECS, load_environment_from_spec

__all__ = ["BUILTIN_SPECS", "GroupEnv", "Mode", "PromptedEnv", "load_environment_from_spec"]
