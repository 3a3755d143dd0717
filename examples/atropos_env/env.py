"""An Atropos environment (a ``BaseEnv`` subclass of atroposlib 0.4.0, unmodified) that a rollhub run trains on.

The task is :mod:`examples.atropos_env.task`: answer ``57=`` with ``7``. It talks to the world only the way any
Atropos environment does: it registers with the buffer server at ``--env.rollout_server_url`` and posts scored
groups there; it samples through an OpenAI-compatible server (``--openai.base_url``, ``--openai.model_name``;
``server_type = "openai"``, so atroposlib's plain OpenAI client is used). Run it from the repository root, in
``serve`` mode, with the values a trainer-only ``rollhub run`` prints (docs/atropos-training.md)::

    python -m examples.atropos_env.env serve --env.rollout_server_url URL --env.tokenizer_name MODEL_DIR \\
        --openai.base_url ENGINE/v1 --openai.model_name MODEL_DIR --openai.server_type openai --openai.api_key x

How it builds a group (``collect_trajectories``): one completions request for the prompt with ``n =
group_size``, ``max_tokens = 1``, ``logprobs = 0`` and vLLM's ``return_token_ids``, so the tokens are exactly
the engine's (``prompt_token_ids`` then ``token_ids``), never the text re-tokenized. ``masks`` are ``-100`` on
the prompt and the token id on the completion; ``inference_logprobs`` are ``1.0`` on the prompt and the engine's
log-prob on the completion (left out with ``--env.send_logprobs False``: the trainer then assumes the data is
on-policy); ``generation_params`` says how it was sampled. Its own evaluation (``evaluate``, every
``steps_per_eval`` trainer steps) decodes the held-out prompts greedily and appends to ``--env.eval_log``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from examples.atropos_env.task import LastDigitTask, Problem
from pydantic import Field


class LastDigitConfig(BaseEnvConfig):
    """BaseEnv's settings and this environment's own."""

    send_logprobs: bool = Field(default=True, description="send the engine's log-probs as inference_logprobs")
    temperature: float = Field(default=1.0, description="sampling temperature of training completions")
    split_seed: int = Field(default=0, description="seeds the held-out split of the task")
    eval_log: str | None = Field(default=None, description="JSONL file each evaluation's accuracy is appended to")


class LastDigitEnv(BaseEnv):
    """Repeat the digit before ``=`` (see :mod:`examples.atropos_env.task`)."""

    name = "last_digit"
    env_config_cls = LastDigitConfig

    @classmethod
    def config_init(cls) -> tuple[LastDigitConfig, list[APIServerConfig]]:
        env = LastDigitConfig(
            group_size=8,
            use_wandb=False,
            wandb_name="last_digit",
            max_token_length=32,
            total_steps=-1,  # as many as the trainer registered
            steps_per_eval=25,
            max_batches_offpolicy=2,
            tokenizer_name="set --env.tokenizer_name to the model directory the run prints",
        )
        server = APIServerConfig(
            server_type="openai",
            base_url="http://127.0.0.1:8001/v1",
            model_name="set --openai.model_name to the served model name the run prints",
            api_key="x",
            health_check=False,  # its probe prompt "hi" is outside the tiny model's alphabet
            num_requests_for_eval=32,
        )
        return env, [server]

    async def setup(self) -> None:
        self.task = LastDigitTask(self.config.split_seed)
        self.rng = random.Random(self.config.split_seed)
        self.order: list[Problem] = []

    async def get_next_item(self) -> Problem:
        """The training problems in a fresh shuffled order each pass."""
        if not self.order:
            self.order = list(self.task.train)
            self.rng.shuffle(self.order)
        return self.order.pop()

    async def collect_trajectories(self, item: Problem) -> tuple[ScoredDataGroup | None, list[Problem]]:
        completion = await self.server.completion(
            prompt=item.prompt,
            n=self.config.group_size,
            max_tokens=1,
            temperature=self.config.temperature,
            logprobs=0,
            extra_body={"return_token_ids": True},
        )
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
        for choice in completion.choices:
            prompt_ids, ids = list(choice.prompt_token_ids), list(choice.token_ids)
            group["tokens"].append(prompt_ids + ids)
            group["masks"].append([-100] * len(prompt_ids) + ids)
            group["scores"].append(self.task.score(item, choice.text))
            group["inference_logprobs"].append([1.0] * len(prompt_ids) + list(choice.logprobs.token_logprobs))
        if not self.config.send_logprobs:
            del group["inference_logprobs"]
        group["generation_params"] = {"temperature": self.config.temperature, "max_tokens": 1}
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        """Greedy accuracy on the held-out prompts. The trainer keeps training meanwhile: the answers may come
        from more than one weight version (``step_first`` and ``step_last`` say which trainer steps it spanned)."""
        first, started = self.curr_step, time.time()
        answers = await asyncio.gather(*[
            self.server.completion(prompt=p.prompt, n=1, max_tokens=1, temperature=0.0, split="eval")
            for p in self.task.held_out
        ])  # fmt: skip
        correct = [self.task.score(p, a.choices[0].text) for p, a in zip(self.task.held_out, answers, strict=True)]
        accuracy = sum(correct) / len(correct)
        if self.config.eval_log:
            row = {"step_first": first, "step_last": self.curr_step, "accuracy": accuracy,
                   "seconds": round(time.time() - started, 3)}  # fmt: skip
            with open(self.config.eval_log, "a") as log:
                log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    LastDigitEnv.cli()
