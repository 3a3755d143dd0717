"""A tiny causal transformer and a local :class:`InferenceContext` around it, for CPU runs.

The model is trained from scratch (no downloads): character-level tokens, learned positions, pre-norm blocks.
:class:`LocalPolicy` samples from it and can have its weights swapped in place while it is being used: a
lock makes each ``complete`` call see one whole set of weights, never a mix.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rollhub.errors import RollhubError
from rollhub.inference.base import Completion, SamplingParams
from rollhub.inference.tokenizer import CharTokenizer
from rollhub.models.sampling import NEUTRAL_PENALTIES, processed_logits


class PolicyError(RollhubError):
    """A prompt or weight set the local policy cannot use."""


@dataclass(frozen=True, slots=True)
class TransformerConfig:
    """Shape of :class:`TinyTransformer`.

    Attributes:
        vocab_size: number of token ids.
        d_model: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block (must divide ``d_model``).
        max_len: longest sequence (prompt plus completion) the model accepts.
    """

    vocab_size: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 32


class _Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One pre-norm block: causal self-attention then an MLP, each added to the residual stream."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A GPT-style causal language model small enough to train on a laptop CPU in minutes."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise PolicyError(f"d_model {cfg.d_model} is not divisible by n_heads {cfg.n_heads}; change one")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[batch, time, vocab]`` for right-padded ``tokens`` ``[batch, time]``."""
        return self.head(self.hidden_states(tokens))

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final normalised residual stream ``[batch, time, d_model]`` (the output head's input)."""
        t = tokens.shape[1]
        if t > self.cfg.max_len:
            raise PolicyError(f"sequence length {t} exceeds max_len {self.cfg.max_len}; raise max_len")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x)


class LocalPolicy:
    """An in-process :class:`~rollhub.inference.base.InferenceContext` over a :class:`TinyTransformer`.

    Prompts are encoded with ``<bos>`` first. Each completion's log-probs are those of the distribution it
    was drawn from: temperature, min-p, top-k and top-p applied as :func:`rollhub.models.sampling.processed_logits`
    defines them, as the trainer computes them (greedy decoding reports the temperature-1 log-probs).
    """

    def __init__(self, model: TinyTransformer, tokenizer: CharTokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def load_weights(self, state: Mapping[str, torch.Tensor | np.ndarray]) -> None:
        """Swap the weights in place; ``complete`` calls in flight finish on the old set.

        Raises:
            PolicyError: the state's names or shapes do not match the model.
        """
        tensors = {k: torch.as_tensor(np.asarray(v)) if not torch.is_tensor(v) else v for k, v in state.items()}
        with self._lock:
            try:
                self.model.load_state_dict(tensors, strict=True)
            except RuntimeError as exc:
                raise PolicyError(f"weights do not fit the model: {exc}; publish weights of this shape") from None

    def complete(
        self, prompts: list[str], n: int, params: SamplingParams, rng: np.random.Generator
    ) -> list[list[Completion]]:
        """Sample ``n`` completions of each prompt (see :class:`InferenceContext`).

        Raises:
            PolicyError: a history-dependent penalty or a stop string is asked for (this policy has neither).
        """
        unsupported = {k: v for k, v in params.generation_params().items() if NEUTRAL_PENALTIES.get(k, v) != v}
        if unsupported or params.stop:
            asked = unsupported or {"stop": params.stop}
            raise PolicyError(f"the local policy has no penalties and stop strings, not {asked}; leave them neutral")
        encoded = [self.tokenizer.encode(p, bos=True) for p in prompts]
        out: list[list[Completion]] = [[] for _ in prompts]
        by_len: dict[int, list[int]] = {}
        for i, ids in enumerate(encoded):
            by_len.setdefault(len(ids), []).append(i)
        gen = torch.Generator().manual_seed(int(rng.integers(2**63 - 1)))
        with self._lock, torch.no_grad():
            for idx in by_len.values():
                prompt = torch.tensor([encoded[i] for i in idx]).repeat_interleave(n, dim=0)
                toks, lps, done = self._sample(prompt, params, gen)
                for row in range(prompt.shape[0]):
                    comp = self._completion(prompt[row], toks[row], lps[row], done[row], params)
                    out[idx[row // n]].append(comp)
        return out

    def _sample(
        self, prompt: torch.Tensor, params: SamplingParams, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seq = prompt
        rows = prompt.shape[0]
        finished = torch.zeros(rows, dtype=torch.bool)
        length = torch.zeros(rows, dtype=torch.long)
        logps = []
        for _ in range(params.max_tokens):
            logits = self.model(seq)[:, -1].float()
            if params.temperature > 0:
                shaped = processed_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p)
                logp = torch.log_softmax(shaped, dim=-1)
                nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            else:
                logp = torch.log_softmax(logits, dim=-1)
                nxt = logits.argmax(-1)
            logps.append(logp.gather(1, nxt[:, None]).squeeze(1))
            length += (~finished).long()
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            if params.stop_eos:
                finished |= nxt == self.tokenizer.eos_id
            if bool(finished.all()):
                break
        return seq[:, prompt.shape[1] :], torch.stack(logps, 1), torch.stack([length, finished.long()], 1)

    def _completion(
        self, prompt: torch.Tensor, toks: torch.Tensor, lps: torch.Tensor, done: torch.Tensor, params: SamplingParams
    ) -> Completion:
        length, stopped = int(done[0]), bool(done[1])
        ids = tuple(int(t) for t in toks[:length])
        return Completion(
            prompt_tokens=tuple(int(t) for t in prompt),
            tokens=ids,
            logprobs=tuple(float(x) for x in lps[:length]),
            text=self.tokenizer.decode(list(ids)),
            finish_reason="stop" if stopped else "length",
            params=params,
        )
