"""How a run config's validation errors read: one line per problem, ``key.path: what is wrong; what to do``."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


def _known_keys(loc: tuple[Any, ...], root: Any) -> list[str]:
    """The keys allowed where ``loc`` points (for an unknown-key error), best effort."""
    model: Any = root
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        model = next((a for a in getattr(annotation, "__args__", ()) if hasattr(a, "model_fields")), annotation)
    return sorted(getattr(model, "model_fields", {}))


def render_errors(exc: ValidationError, source: str, root: Any) -> str:
    """pydantic's errors as lines ``key.path: what is wrong (got VALUE); what to do``; ``root``: the model."""
    lines = [f"{source} is not a valid run config ({exc.error_count()} problem(s)):"]
    for error in exc.errors(include_url=False):
        # discriminated unions add the tag to the path ("weights.ray.kind"); a person writes "weights.kind"
        loc = tuple(part for part in error["loc"] if not isinstance(part, str) or part not in _TAGS)
        path = ".".join(str(part) for part in loc) or "(top level)"
        kind = error["type"]
        if kind == "extra_forbidden":
            known = _known_keys(loc, root)
            hint = f"unknown key; remove it or use one of {', '.join(known)}" if known else "unknown key; remove it"
        elif kind == "union_tag_invalid":
            path = f"{path}.kind"
            hint = f"unknown kind {error['ctx']['tag']!r}; use one of {error['ctx']['expected_tags']}"
        elif kind == "missing":
            hint = "required; set it in the file or with --set " + f"{path}=..."
        else:
            hint = f"{error['msg']} (got {error.get('input')!r}); fix it in the file or with --set {path}=..."
        lines.append(f"  {path}: {hint}")
    return "\n".join(lines)


_TAGS = {"step", "group", "mlp", "transformer", "hf", "vllm", "ray_replay", "server", "in_process", "ppo", "grpo"}
_TAGS |= {"ray", "checkpoint", "jsonl", "wandb"}
