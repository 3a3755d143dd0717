"""The trainer-only plug point of ``rollhub run``: an environment that is another process (``[env] kind =
"external"``), such as an Atropos ``BaseEnv`` in ``serve`` mode.

Such a run starts the buffer server (or uses ``writer.url``), the inference engine (or uses ``inference.url``)
and the GRPO trainer, and no rollout fleet: the environment samples through the engine's OpenAI-compatible
routes and posts scored groups to the server itself; the trainer pushes its weights into the engine after every
update. :func:`rollhub.run.config_checks.external_problems` refuses the settings such a run has no use for,
naming the key.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

EXTERNAL_DEFAULTS = {"policy": "hf", "writer": "server", "trainer": "grpo"}


class ExternalEnvConfig(BaseModel):
    """``[env]`` with ``kind = "external"``: the environment runs as a process of its own and speaks the
    AtroposLib API to the run's buffer server; rollhub runs no rollout fleet."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["external"] = Field(
        "external", description="The environment is another process speaking the AtroposLib API (no fleet)."
    )
    group_size: int = Field(
        8,
        ge=1,
        description="Sequences per group the environment sends (its own `group_size`); a batch is "
        "`trainer.groups_per_batch * group_size` sequences.",
    )
    name: str = Field(
        "external environment", min_length=1, description="How the summary and the learning curve name it."
    )
    eval_id: str | None = Field(
        None,
        description="A rollhub group environment (`package.module:Class` or a built-in short name) whose "
        '`mode="eval"` prompts rollhub evaluates the trainer\'s weights on, through the engine, between updates; '
        "unset: rollhub does not evaluate (the environment evaluates itself, if it does).",
    )
    eval_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of that environment's constructor."
    )
    lesson: str = Field("eval", description="The id of the evaluated lesson.")
