"""How a run config's problems read: one line per problem, ``key.path: what is wrong; what to do`` (validation
errors, and the fleet settings that cannot work together)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


def _known_keys(loc: tuple[Any, ...], root: Any) -> list[str]:
    """The keys allowed where ``loc`` (pydantic's, tags included) points (for an unknown-key error), best effort:
    in a discriminated union the variant the tag after the field names."""
    model: Any = root
    parts = list(loc[:-1])
    while parts:
        field = getattr(model, "model_fields", {}).get(parts.pop(0))
        if field is None:
            return []
        variants = [a for a in getattr(field.annotation, "__args__", ()) if hasattr(a, "model_fields")]
        tagged = {getattr(m, "tag", None): a for a in variants for m in getattr(a, "__metadata__", ())}
        default = variants[0] if variants else field.annotation
        model = tagged[parts.pop(0)] if parts and parts[0] in tagged else default
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
            known = _known_keys(tuple(error["loc"]), root)
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


_TAGS = {"step", "group", "external", "mlp", "transformer", "hf", "vllm", "ray_replay", "server", "in_process"}
_TAGS |= {"ppo", "grpo", "ray", "checkpoint", "jsonl", "wandb"}


def fleet_problems(config: Any) -> list[str]:
    """What cannot work together in ``[fleet]`` and the replay ``[writer]`` of a step run, one line per problem."""
    fleet, writer = config.fleet, config.writer
    problems = []
    if fleet.env_processes is not None and fleet.env_processes > fleet.envs_per_worker:
        problems.append(
            f"  fleet.env_processes: {fleet.env_processes} processes for fleet.envs_per_worker = "
            f"{fleet.envs_per_worker} environments; a process holds at least one, so lower it or raise "
            "fleet.envs_per_worker"
        )
    if fleet.step_threads and fleet.env_processes != 0:
        problems.append(
            f"  fleet.step_threads: step the environments in the worker, so they need fleet.env_processes = 0 "
            f"(got {fleet.env_processes}); set fleet.env_processes = 0 or remove fleet.step_threads"
        )
    if fleet.step_threads > fleet.envs_per_worker:
        problems.append(
            f"  fleet.step_threads: {fleet.step_threads} threads for fleet.envs_per_worker = "
            f"{fleet.envs_per_worker} environments; a thread steps at least one, so lower it (at most "
            f"{fleet.envs_per_worker}: one per environment)"
        )
    if fleet.backend != "ray" and config.env.kind != "step":
        problems.append(
            f"  fleet.backend: {fleet.backend!r} runs step environments only (env.kind = {config.env.kind!r}); "
            "the group path's fleet runs on Ray: remove fleet.backend or set it to 'ray'"
        )
    if getattr(writer, "kind", None) != "ray_replay":
        return problems
    paced = fleet.fragments_per_version
    if paced is not None and paced * fleet.workers < writer.batch_size:
        problems.append(
            f"  fleet.fragments_per_version: {paced} x {fleet.workers} workers make fewer fragments per version "
            f"than a batch (writer.batch_size = {writer.batch_size}); raise it to at least "
            f"{-(-writer.batch_size // fleet.workers)}"
        )
    if paced is not None and writer.max_staleness < 2:
        problems.append(
            f"  fleet.fragments_per_version: pacing needs writer.max_staleness >= 2 (got {writer.max_staleness}): a "
            "paced fragment starts with a step of the version before, so at 1 every one would be dropped as stale; "
            "raise writer.max_staleness or remove fleet.fragments_per_version"
        )
    if writer.max_queued is not None and writer.max_queued < writer.batch_size:
        problems.append(
            f"  writer.max_queued: {writer.max_queued} fragments can never make a batch of writer.batch_size = "
            f"{writer.batch_size}; raise it to at least {writer.batch_size}"
        )
    return problems
