"""A policy that writes what a script says: demonstrations for supervised warm starts, in exact episode tokens.

:class:`ScriptedPolicy` continues token-id prompts as an engine does (:class:`~rollhub.envs.episode.runner.
TokenPolicy`): it decodes the prompt, asks ``script`` for the turn's text, and answers with that text's ids followed
by the stop token, cut at the turn's ``max_tokens``. Run through :func:`~rollhub.envs.episode.runner.run_episodes`,
its episodes are laid out exactly as sampled ones are (the prompt, the turns, the rendered tool results), so the
group's ``masks`` mark the scripted turns and nothing else, and a model fine-tuned on them sees its turns in the
very token context the episode loop gives it later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rollhub.inference.base import Completion, SamplingParams


class ScriptedPolicy:
    """Answers each prompt with ``script(prompt text)`` (see the module docstring); log-probs are 0.

    Args:
        tokenizer: the model's Hugging Face tokenizer (its ``eos_token_id`` ends every turn).
        script: the text of a turn from the conversation so far (special tokens included), drawing any randomness
            from the generator it is given.
    """

    def __init__(self, tokenizer: Any, script: Callable[[str, np.random.Generator], str]) -> None:
        self.tokenizer = tokenizer
        self.script = script

    def complete(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 rng: np.random.Generator) -> list[list[Completion]]:  # fmt: skip
        """``n`` scripted turns per prompt."""
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
            turns = []
            for _ in range(n):
                ids = [*self.tokenizer(self.script(text, rng), add_special_tokens=False)["input_ids"],
                       self.tokenizer.eos_token_id]  # fmt: skip
                finish = "stop" if len(ids) <= params.max_tokens else "length"
                ids = ids[: params.max_tokens]
                shown = self.tokenizer.decode(ids, skip_special_tokens=True)
                turns.append(Completion(tuple(prompt), tuple(ids), (0.0,) * len(ids), shown, finish, params))
            out.append(turns)
        return out
