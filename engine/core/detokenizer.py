"""Incremental detokenization: a growing token stream in, text deltas that are safe to emit out.

Three things are held back, and only for as long as they must be:
- bytes of a UTF-8 character whose remaining bytes have not been generated yet;
- text that could still be the start of a stop string;
- nothing else. Concatenating every `push` and the final `finish` gives exactly
  `tokenizer.decode(all_ids, skip_special_tokens=...)`, cut before the first stop string.

Work per push is proportional to the new text times the number of stop strings, never to the text
generated so far nor to the square of a stop string's length: each stop string keeps a KMP state
(how much of it the text ends with), advanced one character at a time.
"""

from __future__ import annotations

import codecs
from typing import Sequence

from engine.tokenizers.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(s for s in dict.fromkeys(stop) if s)  # unique, non-empty, in order
        self._matchers = [_PrefixMatcher(s) for s in self._stops]
        # codecs' incremental decoder holds back an incomplete UTF-8 sequence and replaces invalid
        # bytes exactly as a one-shot bytes.decode(errors="replace") would
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True  # no visible (non-special) token yet
        self._pending = ""  # decoded text not emitted yet: a possible start of a stop string
        self.stop_matched: str | None = None
        self._finished = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Text that is safe to emit after these tokens; "" once a stop string matched."""
        if self.stop_matched is not None or self._finished:
            return ""
        new_text = self._utf8.decode(self._bytes_of(token_ids))
        self._pending += new_text
        for matcher in self._matchers:
            matcher.feed(new_text)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush what was held back because the sequence ended for another reason (a stop token,
        the length limit). Incomplete UTF-8 at the very end becomes U+FFFD, as in `decode`."""
        if self.stop_matched is not None or self._finished:
            return ""
        self._pending += self._utf8.decode(b"", final=True)
        text = self._release(final=True)
        self._finished = True
        return text

    def _bytes_of(self, token_ids: Sequence[int]) -> bytes:
        tokenizer = self._tokenizer
        parts: list[bytes] = []
        for token_id in token_ids:
            special = tokenizer.is_special(token_id)
            if special and self._skip_special_tokens:
                continue
            if self._at_start and not special:
                self._at_start = False
                parts.append(tokenizer.first_token_bytes(token_id))
            else:
                parts.append(tokenizer.token_bytes(token_id))
        return b"".join(parts)

    def _release(self, *, final: bool) -> str:
        pending = self._pending
        if not self._stops:
            self._pending = ""
            return pending
        # Earlier text was emitted only when no suffix of it could start a stop string, so a stop
        # string can only begin inside `pending`: searching it alone is enough.
        cut = self._first_stop(pending)
        if cut is not None:
            self._pending = ""
            return pending[:cut]
        keep = 0 if final else min(len(pending), max(m.matched for m in self._matchers))
        self._pending = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def _first_stop(self, text: str) -> int | None:
        """Index where the earliest stop string starts (ties: the one listed first); sets stop_matched."""
        best: int | None = None
        for stop in self._stops:
            at = text.find(stop)
            if at != -1 and (best is None or at < best):
                best, self.stop_matched = at, stop
        return best


class _PrefixMatcher:
    """How long a prefix of `pattern` the text fed so far ends with (Knuth-Morris-Pratt)."""

    __slots__ = ("pattern", "failure", "matched")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.failure = [0] * len(pattern)  # [i]: longest proper border of pattern[: i + 1]
        k = 0
        for i in range(1, len(pattern)):
            while k and pattern[i] != pattern[k]:
                k = self.failure[k - 1]
            if pattern[i] == pattern[k]:
                k += 1
            self.failure[i] = k
        self.matched = 0

    def feed(self, text: str) -> None:
        pattern, failure, k = self.pattern, self.failure, self.matched
        for char in text:
            if k == len(pattern):  # a full match (the caller stops at it); keep scanning past it
                k = failure[k - 1]
            while k and char != pattern[k]:
                k = failure[k - 1]
            if char == pattern[k]:
                k += 1
        self.matched = k
