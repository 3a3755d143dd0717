"""Request models of the AtroposLib 0.4.0 wire contract, plus rollhub's optional extensions.

These pydantic models are what crosses the HTTP boundary as JSON and what the OpenAPI schema shows. The hot
data path (``/scored_data``) does not build :class:`ScoredData` for every request: it converts straight into
the compact :class:`rollhub.wire.group.Group` and only falls back to this model to produce a faithful 422
for a malformed body. Unknown fields are ignored, as in 0.4.0.

Ids, counts and steps are strict integers and weights strict numbers: AtroposLib 0.4.0's clients send JSON
integers and numbers, and a boolean, a string or a fraction in their place is a mistake (``{"env_id": false}``
must not name env 0), answered 422. A number field still takes an integer, and in-process callers may pass numpy
integers and floats.
"""

from __future__ import annotations

import numbers
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field, create_model, field_validator
from pydantic_core import PydanticCustomError

from rollhub.experience.group import META_FIELDS


def _integer(value: Any) -> Any:
    """An integer (Python or numpy), never a boolean, a string or a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return int(value)


def _number(value: Any) -> Any:
    """A real number (Python or numpy, integers included), never a boolean or a string."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return float(value)


#: An integer on the wire: JSON integers only (see the module docstring).
WireInt = Annotated[int, BeforeValidator(_integer)]
#: A number on the wire: JSON numbers only.
WireFloat = Annotated[float, BeforeValidator(_number)]


class Registration(BaseModel):
    """``POST /register``: the trainer's run parameters (all required, as in 0.4.0)."""

    wandb_group: str
    wandb_project: str
    batch_size: WireInt
    max_token_len: WireInt
    checkpoint_dir: str
    save_checkpoint_interval: WireInt
    starting_step: WireInt
    num_steps: WireInt


class RegisterEnv(BaseModel):
    """``POST /register-env``: one rollout handler announcing itself."""

    max_token_length: WireInt
    desired_name: str
    weight: WireFloat
    group_size: WireInt
    min_batch_allocation: WireFloat | None = Field(
        default=None, description="Minimum fraction (0..1) of every batch this env must fill."
    )


class EnvIdentifier(BaseModel):
    """``{"env_id": N}`` for ``/disconnect-env`` and ``/status-env``."""

    env_id: WireInt


def check_messages(value: Any) -> Any:
    """Every message must be a dict with ``role`` and ``content`` (as 0.4.0 checks)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError("messages must be a list of lists of {'role', 'content'} dicts")
    for i, conversation in enumerate(value):
        if not isinstance(conversation, list):
            raise ValueError(f"messages[{i}] must be a list of message dicts")
        for j, msg in enumerate(conversation):
            if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
                raise ValueError(f"messages[{i}][{j}] must have 'role' and 'content' fields")
    return value


class ScoredData(BaseModel):
    """One scored group: ``n`` sequences sampled for one prompt, with their scores.

    ``policy_version`` is a rollhub extension: the trainer step whose weights produced the group. Atropos
    clients leave it out; when the server has ``max_staleness`` set, groups older than
    ``current_step - max_staleness`` are never served. ``token_versions`` is another: one row per sequence,
    as long as its token row, holding the policy version that sampled each completion token and -1 on the
    positions the policy did not sample; a producer that sends it sends ``policy_version`` as its oldest
    sampled version. Both are served back only when set, and AtroposLib ignores them (it ignores unknown
    fields).
    """

    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict] | None = None
    group_overrides: dict | None = None
    images: Any | None = None
    env_id: WireInt | None = None
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None
    policy_version: WireInt | None = Field(
        default=None, description="rollhub extension: trainer step of the weights that produced this group."
    )
    token_versions: list[list[int]] | None = Field(
        default=None,
        description="rollhub extension: per token, the policy version that sampled it (-1 where not sampled).",
    )

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_have_role_and_content(cls, v: Any) -> Any:
        return check_messages(v)


#: The small, non-array fields of a group: what a body the fast paths decode still has pydantic check.
SMALL_FIELDS = (*META_FIELDS, "env_id", "policy_version")

ScoredDataMeta = create_model(
    "ScoredDataMeta",
    __doc__="The small, non-array fields of :class:`ScoredData` (:data:`SMALL_FIELDS`, declared as there), "
    "validated by pydantic on the fast path.",
    __module__=__name__,
    __validators__={
        "_messages_have_role_and_content": field_validator("messages", mode="before")(check_messages),
    },
    **{name: (ScoredData.model_fields[name].annotation, ScoredData.model_fields[name]) for name in SMALL_FIELDS},
)


#: The keys of a served item, in the order 0.4.0 emits them (the example trainer indexes them directly).
ITEM_KEYS: tuple[str, ...] = (
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "inference_logprobs",
    "overrides",
    "group_overrides",
    "images",
    "env_id",
    "distill_token_ids",
    "distill_logprobs",
)
