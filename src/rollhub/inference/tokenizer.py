"""A character-level tokenizer for the small CPU policies (no downloads, no vocabulary files).

Every character of ``alphabet`` is one token; three special tokens come first: ``<pad>`` (0), ``<bos>`` (1)
and ``<eos>`` (2). Encoding is exact and reversible for text drawn from the alphabet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollhub.errors import RollhubError


class TokenizerError(RollhubError):
    """Text holds a character the tokenizer does not know, or an id is outside the vocabulary."""


PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS: tuple[str, ...] = (PAD, BOS, EOS)


@dataclass(frozen=True)
class CharTokenizer:
    """Maps each character of ``alphabet`` to one token id, after the three special tokens.

    Attributes:
        alphabet: the characters the tokenizer accepts, each once.
    """

    alphabet: str = "0123456789+-*= "
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(set(self.alphabet)) != len(self.alphabet):
            raise TokenizerError(f"alphabet {self.alphabet!r} repeats a character; give each character once")
        object.__setattr__(self, "_ids", {c: i + len(SPECIALS) for i, c in enumerate(self.alphabet)})

    @property
    def vocab_size(self) -> int:
        """Number of token ids (specials included)."""
        return len(SPECIALS) + len(self.alphabet)

    @property
    def pad_id(self) -> int:
        """Id of ``<pad>``."""
        return 0

    @property
    def bos_id(self) -> int:
        """Id of ``<bos>``, put before every prompt by the local policy."""
        return 1

    @property
    def eos_id(self) -> int:
        """Id of ``<eos>``, which ends a completion."""
        return 2

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally after ``<bos>``.

        Raises:
            TokenizerError: a character is not in the alphabet.
        """
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as exc:
            raise TokenizerError(
                f"character {exc.args[0]!r} in {text!r} is not in the alphabet {self.alphabet!r}; "
                "extend the alphabet or change the prompt"
            ) from None
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special`` is False."""
        out = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary of size {self.vocab_size}")
            if i < len(SPECIALS):
                if not skip_special:
                    out.append(SPECIALS[i])
            else:
                out.append(self.alphabet[i - len(SPECIALS)])
        return "".join(out)

    def token_text(self, i: int) -> str:
        """The text of one token id, specials as their names (what an OpenAI server reports per token)."""
        return self.decode([i], skip_special=False)
