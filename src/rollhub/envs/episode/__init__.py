"""Multi-turn environments: episodes of model and environment turns with exact tokens, tools, and their groups.

The protocol (:mod:`~rollhub.envs.episode.base`), tools (:mod:`~rollhub.envs.episode.tools`), rendering as token
deltas (:mod:`~rollhub.envs.episode.render`), the rows of an episode (:mod:`~rollhub.envs.episode.tokens`), the
episode and its group (:mod:`~rollhub.envs.episode.episode`) and the loop (:mod:`~rollhub.envs.episode.runner`).
"""

from __future__ import annotations

from rollhub.envs.episode.base import EpisodeEnv, ToolEnv
from rollhub.envs.episode.episode import Episode, episodes_to_group
from rollhub.envs.episode.render import ChatRenderer, Extension, RenderError
from rollhub.envs.episode.runner import EpisodeGroupEnv, run_episodes
from rollhub.envs.episode.tokens import EpisodeTokens, TokenDriftError, TokenRow
from rollhub.envs.episode.tools import Tool, ToolCall, ToolResult, parse_tool_calls, run_tool_call
from rollhub.envs.episode.types import EnvReply, EpisodeLimits, Finish, ModelTurn, Outcome, Task

__all__ = [
    "ChatRenderer",
    "EnvReply",
    "Episode",
    "EpisodeEnv",
    "EpisodeGroupEnv",
    "EpisodeLimits",
    "EpisodeTokens",
    "Extension",
    "Finish",
    "ModelTurn",
    "Outcome",
    "RenderError",
    "Task",
    "TokenDriftError",
    "TokenRow",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolResult",
    "episodes_to_group",
    "parse_tool_calls",
    "run_episodes",
    "run_tool_call",
]
