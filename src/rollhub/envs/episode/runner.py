"""The episode loop: model turns batched over every live episode, environment replies rendered as token deltas.

:func:`run_episodes` runs ``n`` episodes of each task together. Each round sends every live episode's current row
(token ids) as a prompt, one request per distinct turn cap, so the engine continues exactly the ids the row holds
(:class:`~rollhub.envs.episode.tokens.EpisodeTokens` checks the ids it echoes). Then each environment replies, its
messages are rendered as a delta onto the row, or start a new row when the template rewrites history
(:mod:`rollhub.envs.episode.render`).

Budgets are the episode's, not the turn's: a turn may sample ``min(turn_max_tokens, max_tokens - len(row))``
tokens. An episode ends when its environment says done, when a turn is cut (``length``: at ``turn_max_tokens``;
``budget``: at what was left of ``max_tokens``), when the next delta leaves no room for a token (``budget``), or
after ``max_turns`` turns; every ending but ``done`` flags it truncated (the cut turn is still given to the
environment, which scores it). A turn the engine aborted ends its episode with ``abort``, and
:class:`EpisodeGroupEnv` leaves that whole task out, as single-turn environments leave out a prompt with an
aborted completion.

:class:`EpisodeGroupEnv` wraps an :class:`~rollhub.envs.episode.base.EpisodeEnv` as a
:class:`~rollhub.envs.group.base.GroupEnv`, so episodes go through the rollout manager, the fleets, the buffer
and the GRPO trainer as groups.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from rollhub.envs.episode.base import EpisodeEnv
from rollhub.envs.episode.episode import Episode, episodes_to_group
from rollhub.envs.episode.render import ChatRenderer
from rollhub.envs.episode.tokens import EpisodeTokens
from rollhub.envs.episode.types import EpisodeLimits, ModelTurn, Task
from rollhub.envs.group.base import Mode
from rollhub.experience import Group
from rollhub.inference.base import Completion, SamplingParams


class TokenPolicy(Protocol):
    """A policy that continues token-id prompts (the OpenAI client does, with ``return_token_ids``)."""

    def complete(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 rng: np.random.Generator) -> list[list[Completion]]: ...  # fmt: skip


def start_episode(task: Task, k: int, renderer: ChatRenderer) -> Episode:
    """Episode ``k`` of ``task``, its row holding the first prompt. Its id, ``"<task id>/<k>/<random hex>"``, is
    unique beyond its group, so groups the buffer merges never mix two episodes' rows."""
    prompt = renderer.prompt(task.messages, task.tools)
    episode_id = f"{task.id}/{k}/{uuid.uuid4().hex[:12]}"
    return Episode(task, episode_id, EpisodeTokens(prompt), [dict(m) for m in task.messages])


def take_turn(env: EpisodeEnv, renderer: ChatRenderer, episode: Episode, completion: Completion, cap: int,
              limits: EpisodeLimits, version: int | None) -> None:  # fmt: skip
    """Record one sampled turn, let the environment reply, and append its messages (or end the episode)."""
    if completion.finish_reason == "abort":
        episode.finish = "abort"
        return
    episode.tokens.sampled(completion, version)
    turn = ModelTurn(episode.turns, completion.text, completion.tokens, completion.finish_reason)
    episode.messages.append({"role": "assistant", "content": completion.text})
    reply = env.step(episode.task, episode, turn)
    episode.turn_rewards.append(float(reply.reward))
    if completion.finish_reason == "length":
        episode.finish = "length" if cap == limits.turn_max_tokens else "budget"
    elif reply.done:
        episode.finish = "done"
    elif episode.turns >= limits.max_turns:
        episode.finish = "max_turns"
    if episode.finish is not None:
        return
    stop = completion.tokens[-1] if completion.tokens else None
    ext = renderer.extend(episode.messages, reply.messages, episode.task.tools, stop)
    length = len(ext.ids) if ext.forked else len(episode.tokens.current) + len(ext.ids)
    if length >= limits.max_tokens:  # no room left for a single sampled token
        episode.finish = "budget"
        return
    if ext.forked:
        episode.tokens.fork(ext.ids)
        episode.forks.append(ext.reason)
    else:
        episode.tokens.environment(ext.ids)
    episode.messages += [dict(m) for m in reply.messages]


def run_episodes(env: EpisodeEnv, policy: TokenPolicy, renderer: ChatRenderer, tasks: Sequence[Task], n: int,
                 limits: EpisodeLimits, params: SamplingParams, rng: np.random.Generator,
                 version: int | None = None) -> list[list[Episode]]:  # fmt: skip
    """Run ``n`` episodes of each task to their end; judge every one that was not aborted.

    Args:
        env: the environment.
        policy: samples turns from token-id prompts.
        renderer: the model's chat template.
        tasks: the tasks.
        n: episodes per task.
        limits: the budgets.
        params: the sampling settings of every turn (``max_tokens`` is set per turn from ``limits``).
        rng: passed to the policy.
        version: the policy version sampling, recorded on every sampled token of a turn whose completion reports
            no per-token ``versions`` (``None``: not known here).

    Returns:
        per task, its ``n`` episodes.
    """
    episodes = [[start_episode(task, k, renderer) for k in range(n)] for task in tasks]
    live = [ep for eps in episodes for ep in eps]
    while live:
        by_cap: dict[int, list[Episode]] = {}
        for ep in live:
            room = limits.max_tokens - len(ep.tokens.current)
            if room <= 0:
                ep.finish = "budget"
            else:
                by_cap.setdefault(min(limits.turn_max_tokens, room), []).append(ep)
        for cap, batch in sorted(by_cap.items()):
            prompts = [list(ep.tokens.current.tokens) for ep in batch]
            sampled = policy.complete(prompts, 1, dataclasses.replace(params, max_tokens=cap), rng)
            for ep, comps in zip(batch, sampled, strict=True):
                take_turn(env, renderer, ep, comps[0], cap, limits, version)
        live = [ep for ep in live if ep.finish is None]
    for eps in episodes:
        for ep in eps:
            if ep.finish != "abort":
                ep.outcome = env.outcome(ep.task, ep)
    return episodes


class EpisodeGroupEnv:
    """An :class:`~rollhub.envs.episode.base.EpisodeEnv` as a :class:`~rollhub.envs.group.base.GroupEnv`: each
    task drawn becomes one group of ``n_generations`` episodes (:func:`episodes_to_group`).

    Args:
        env: the multi-turn environment.
        renderer: the policy model's chat template (:class:`~rollhub.envs.episode.render.ChatRenderer`).
        limits: the episode budgets.
        sampling: the training turns' sampling settings (``max_tokens`` comes from ``limits``); evaluation
            decodes greedily.
    """

    def __init__(self, env: EpisodeEnv, renderer: ChatRenderer, limits: EpisodeLimits,
                 sampling: SamplingParams | None = None) -> None:  # fmt: skip
        self.env = env
        self.name = env.name
        self.renderer = renderer
        self.limits = limits
        self.sampling = dataclasses.replace(sampling or SamplingParams(), max_tokens=limits.turn_max_tokens)

    def sample(self, inference_ctx: TokenPolicy, n_examples: int, n_generations: int, mode: Mode,
               rng: np.random.Generator) -> tuple[list[Group], dict[str, float]]:  # fmt: skip
        """See :class:`~rollhub.envs.group.base.GroupEnv`; a task with an aborted turn gives no group."""
        tasks = self.env.tasks(n_examples, mode, rng)
        params = self.sampling if mode == "train" else dataclasses.replace(self.sampling, temperature=0.0)
        runs = run_episodes(self.env, inference_ctx, self.renderer, tasks, n_generations, self.limits, params, rng)
        kept = [eps for eps in runs if all(ep.finish != "abort" for ep in eps)]
        discount, params_seen = self.limits.discount, params.generation_params()
        groups = [episodes_to_group(self.name, eps, discount, params_seen) for eps in kept]
        return groups, episode_metrics(kept, discount, len(runs) - len(kept))


def episode_metrics(runs: Sequence[Sequence[Episode]], discount: float = 1.0, aborted_tasks: int = 0
                    ) -> dict[str, float]:  # fmt: skip
    """Per episode (not per row): the mean score, the share solved (``accuracy``), mean turns, the truncated and
    forked shares, tool calls and failed calls; the share of tasks whose episodes' scores differ
    (``informative_groups``, what GRPO learns from); tasks left out for an aborted turn."""
    episodes = [ep for eps in runs for ep in eps]
    n = max(len(episodes), 1)
    spread = [np.ptp([ep.score(discount) for ep in eps]) > 0 for eps in runs if eps]
    return {
        "mean_reward": sum(ep.score(discount) for ep in episodes) / n,
        "accuracy": sum(bool(ep.outcome and ep.outcome.correct) for ep in episodes) / n,
        "informative_groups": float(np.mean(spread)) if spread else 0.0,
        "mean_turns": sum(ep.turns for ep in episodes) / n,
        "truncated_fraction": sum(ep.truncated for ep in episodes) / n,
        "forked_fraction": sum(len(ep.tokens.rows) > 1 for ep in episodes) / n,
        "tool_calls": sum(ep.state.get("tool_calls", 0) for ep in episodes) / n,
        "tool_errors": sum(ep.state.get("tool_errors", 0) for ep in episodes) / n,
        "aborted_tasks": float(aborted_tasks),
    }
