"""The shared bases of the tokenizers (tokenizer.py's tiktoken and sentencepiece ones, hf.py's):
name <-> id lookups of a vocabulary's special tokens, and the text path of tokenizers that keep one
byte string per token id. Apart from both modules so that neither imports the other to share them.
"""

from __future__ import annotations

import functools
import re
from typing import Iterator, Sequence


class SpecialTokenTable:
    """Name <-> id lookups of a vocabulary's special tokens; subclasses fill `special_tokens` and
    `_special_names` (its inverse)."""

    special_tokens: dict[str, int]
    _special_names: dict[int, str]

    def special_token_id(self, name: str) -> int:
        try:
            return self.special_tokens[name]
        except KeyError:
            raise KeyError(f"no special token {name!r} in this vocabulary") from None

    def special_token_name(self, token_id: int) -> str | None:
        return self._special_names.get(token_id)

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str]:
        """Built on first use: most tokenizers never parse special spellings. Longest first."""
        spellings = sorted(self.special_tokens, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, spellings)) or r"(?!)")

    def split_special(self, text: str) -> Iterator[str | int]:
        """`text` as pieces of plain text and special-token ids."""
        last = 0
        for match in self._special_pattern.finditer(text):
            if match.start() > last:
                yield text[last : match.start()]
            yield self.special_tokens[match.group(0)]
            last = match.end()
        if last < len(text):
            yield text[last:]


class ByteTableTokenizer(SpecialTokenTable):
    """Shared text path of tokenizers that keep one byte string per token id (`_bytes`): encoding
    wraps `_encode_text` with bos/eos, and decoding concatenates token bytes, so one-shot and
    incremental decoding (engine/core/detokenizer.py) follow one rule. Subclasses set vocab_size,
    bos_id, eos_id, _bytes and implement _encode_text, is_special and first_token_bytes."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    _bytes: list[bytes] | dict[int, bytes]

    def _encode_text(self, text: str) -> list[int]:
        raise NotImplementedError

    def is_special(self, token_id: int) -> bool:
        raise NotImplementedError

    def first_token_bytes(self, token_id: int) -> bytes:
        raise NotImplementedError

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, parse_special: bool = False) -> list[int]:
        ids: list[int] = [self.bos_id] if bos and self.bos_id is not None else []
        if parse_special:
            for piece in self.split_special(text):
                ids.extend(self._encode_text(piece) if isinstance(piece, str) else (piece,))
        else:
            ids.extend(self._encode_text(text))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        parts: list[bytes] = []
        at_start = True
        for token_id in token_ids:
            special = self.is_special(token_id)
            if special and skip_special_tokens:
                continue
            if at_start and not special:
                parts.append(self.first_token_bytes(token_id))
                at_start = False
            else:
                parts.append(self.token_bytes(token_id))
        return b"".join(parts).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            return b""
        return self._bytes[token_id]
