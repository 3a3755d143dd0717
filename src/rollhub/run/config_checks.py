"""The checks of a whole run config, across its sections, and how its problems read: one line per problem,
``key.path: what is wrong; what to do``.

:func:`with_group_defaults` and :func:`kind_problems` judge the raw tables (the plug-point kinds that go with
``env.kind``); :func:`render_errors` words pydantic's validation errors; :func:`combination_problems`,
:func:`fleet_problems` and :func:`external_problems` judge the validated config's settings that cannot work
together. :func:`rollhub.run.config.load_config` runs them all.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from rollhub.envs.group.spec import BUILTIN_SPECS
from rollhub.run.config_external import EXTERNAL_DEFAULTS
from rollhub.run.config_group import GROUP_DEFAULTS


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
    if writer.kind != "ray_replay":
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


def with_group_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``policy``, ``writer`` and ``trainer`` defaulting to the group kinds when ``env.kind`` is
    ``"group"`` (``hf``, ``server`` and ``grpo`` when it is ``"external"``) and they name no kind."""
    env = data.get("env")
    kind_of_env = env.get("kind") if isinstance(env, dict) else None
    if kind_of_env not in ("group", "external"):
        return data
    out = dict(data)
    for key, kind in (GROUP_DEFAULTS if kind_of_env == "group" else EXTERNAL_DEFAULTS).items():
        table = out.get(key, {})
        if isinstance(table, dict) and "kind" not in table:
            out[key] = {**table, "kind": kind}
    return out


_STEP = {"policy": "mlp", "writer": "ray_replay", "trainer": "ppo"}
_GROUP = {"policy": "transformer or hf", "writer": "server or in_process", "trainer": "grpo"}
_EXTERNAL = {"policy": "hf", "writer": "server", "trainer": "grpo"}


def _kind_of(data: dict[str, Any], key: str, default: str) -> Any:
    table = data.get(key, {})
    return table.get("kind", default) if isinstance(table, dict) else default


def kind_problems(data: dict[str, Any]) -> list[str]:
    """Lines ``key: what is wrong; what to do`` for plug-point kinds that do not go with ``env.kind``, judged
    on the raw tables (before their keys are, so a mismatch is named as such, not as unknown keys)."""
    env_kind = _kind_of(data, "env", "step")
    wanted = {"step": _STEP, "group": _GROUP, "external": _EXTERNAL}.get(env_kind)
    if wanted is None:
        return []  # reported by validation as an unknown kind
    problems = []
    for key, default in _STEP.items():
        kind, allowed = _kind_of(data, key, default), wanted[key].split(" or ")
        if kind not in allowed and kind in {*_STEP.values(), "transformer", "hf", "server", "in_process", "grpo"}:
            problems.append(
                f"  {key}.kind: {kind!r} does not go with env.kind = {env_kind!r}; "
                f"use {' or '.join(repr(k) for k in allowed)}"
            )
    return problems


def combination_problems(config: Any) -> list[str]:
    """Lines ``key: what is wrong; what to do`` for settings that do not fit the run's kind (empty: they do)."""
    group = config.env.kind in ("group", "external")
    problems = []
    if group and config.run.target_return is not None:
        problems.append("  run.target_return: a group run has no episodes; use eval.target_accuracy")
    if not group and config.eval.target_accuracy is not None:
        problems.append("  eval.target_accuracy: a step run has no held-out evaluation; use run.target_return")
    if not group and config.sampling.overrides():
        problems.append("  sampling: sampling settings are for a group environment (env.kind = 'group'); remove it")
    if not group and config.curriculum.lessons:
        problems.append("  curriculum.lessons: lessons are for a group environment (env.kind = 'group')")
    if group and config.policy.kind == "transformer" and config.policy.d_model % config.policy.n_heads:
        problems.append(f"  policy.d_model: {config.policy.d_model} is not a multiple of policy.n_heads")
    return problems + episode_problems(config)


def episode_problems(config: Any) -> list[str]:
    """Lines ``key: what is wrong; what to do`` for a multi-turn environment (``[env.episode]``) in a run that
    cannot sample or train its episodes (empty: none, or no such environment)."""
    episode = getattr(config.env, "episode", None)
    spec = config.env.kind == "group" and config.env.id == "episodes"  # the built-in spec, its limits in env.kwargs
    problems = []
    if (episode is not None or spec) and config.sampling.max_tokens is not None:
        problems.append(
            "  sampling.max_tokens: an episode's turns are capped by env.episode.turn_max_tokens and what is left "
            "of env.episode.max_tokens; remove sampling.max_tokens"
        )
    if episode is None:
        return problems
    if config.policy.kind != "hf":
        problems.append(
            f"  env.episode: episodes are rendered with a chat template and sampled from token-id prompts through "
            f"an engine, which policy.kind = {config.policy.kind!r} has not; use policy.kind = 'hf'"
        )
    elif episode.max_tokens > config.policy.max_len:
        problems.append(
            f"  env.episode.max_tokens: {episode.max_tokens} exceeds policy.max_len {config.policy.max_len} (the "
            "longest sequence the engine and the buffer take); lower it or raise policy.max_len"
        )
    if spec:
        problems.append(
            "  env.id: with [env.episode], env.id names the multi-turn environment itself (calculator or "
            "'package.module:Class'), not the 'episodes' spec; set env.id to it and its arguments in env.kwargs"
        )
    elif config.env.id in BUILTIN_SPECS:
        problems.append(
            f"  env.id: {config.env.id!r} is a single-turn group environment, not a multi-turn one; remove "
            "[env.episode], or name a multi-turn environment (calculator or 'package.module:Class')"
        )
    return problems


def external_problems(config: Any) -> list[str]:
    """Lines ``key: what is wrong; what to do`` for settings a trainer-only run cannot use (empty: none).

    Sections are compared with their defaults, since a run directory's ``config.toml`` writes every section out.
    """

    if config.env.kind != "external":
        return []
    problems = []
    if config.fleet != type(config.fleet)():
        problems.append(
            "  fleet: a run with env.kind = 'external' starts no rollout fleet (the environment is its own "
            "process and samples through the engine); remove [fleet]"
        )
    if config.curriculum != type(config.curriculum)():
        problems.append(
            "  curriculum: an external environment chooses its own prompts; remove [curriculum] (env.eval_id "
            "names what rollhub evaluates on)"
        )
    if config.env.eval_id is None and config.eval != type(config.eval)():
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
