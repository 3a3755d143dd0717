"""The trainer-only plug point of ``rollhub run``: an environment that is another process (``[env] kind =
"external"``), such as an Atropos ``BaseEnv`` in ``serve`` mode.

Such a run starts the buffer server (or uses ``writer.url``), the inference engine (or uses ``inference.url``)
and the GRPO trainer, and no rollout fleet: the environment samples through the engine's OpenAI-compatible
routes and posts scored groups to the server itself; the trainer pushes its weights into the engine after every
update. :func:`external_problems` refuses the settings such a run has no use for, naming the key.
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


def external_problems(config: Any) -> list[str]:
    """Lines ``key: what is wrong; what to do`` for settings a trainer-only run cannot use (empty: none).

    Sections are compared with their defaults, since a run directory's ``config.toml`` writes every section out.
    """
    from rollhub.run.config import FleetSection
    from rollhub.run.config_group import CurriculumSection, EvalSection

    if config.env.kind != "external":
        return []
    problems = []
    if config.fleet != FleetSection():
        problems.append(
            "  fleet: a run with env.kind = 'external' starts no rollout fleet (the environment is its own "
            "process and samples through the engine); remove [fleet]"
        )
    if config.curriculum != CurriculumSection():
        problems.append(
            "  curriculum: an external environment chooses its own prompts; remove [curriculum] (env.eval_id "
            "names what rollhub evaluates on)"
        )
    if config.env.eval_id is None and config.eval != EvalSection():
        key = "eval.target_accuracy" if config.eval.target_accuracy is not None else "eval"
        problems.append(
            f"  {key}: rollhub evaluates a run with env.kind = 'external' only on env.eval_id (the environment's "
            "own evaluation is its own); set env.eval_id or remove it"
        )
    if config.inference.per_worker:
        problems.append(
            "  inference.per_worker: a trainer-only run has no rollout workers; one engine serves the external "
            "environment: remove it"
        )
    return problems
