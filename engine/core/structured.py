"""Constrained decoding: grammars compiled by llguidance, one matcher per sequence, token masks.

Why llguidance (measured against xgrammar 0.2.9 on the 2-core dev CPU, a nested 6-field schema):
it compiles a schema in 1-5 ms (xgrammar 14-37 ms), bounds compile and per-step work with
fuel limits (`LLParserLimits`) instead of running unbounded, names the JSON-schema keyword it
cannot enforce, and is one self-contained wheel (xgrammar pulls transformers and triton). Its
masks cost more (batch 32: 0.6 ms at vocab 49152, 3.8 ms at 128256, against 0.1 / 0.5 ms), still
a few percent of a decode step on this CPU.

The pieces:
- `GrammarCompiler` (one per engine): the vocabulary as llguidance sees it, built on first use
  from any of our tokenizers (tiktoken, sentencepiece, tokenizer.json: they all give token bytes),
  and a bounded LRU of compiled grammars. `prepare()` compiles off the engine thread under a time
  limit, so a slow schema is a 400, never a stalled engine.
- `GrammarState` (one per sequence, `Sequence.grammar`): a copy of the compiled matcher. It
  advances only on sampled tokens, so preemption (recompute), prefix-cache hits and n > 1 (one
  state per choice) need nothing special.
- engine/core/sampler.py masks a step's constrained rows, all computed in one call (llguidance's thread
  pool); unconstrained rows are not touched. This module imports neither torch nor numpy.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from typing import Any, Sequence

from engine.types import GrammarSpec, InvalidRequest

DEFAULT_CACHE_SIZE = 128  # compiled grammars kept per engine (a compiled matcher is tens of KB)
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# How JSON is laid out: `{"a": 1, "b": [2, 3]}`, as json.dumps writes it and models have seen most.
# Without flexible whitespace a model cannot pad the output with blanks until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads: every token's bytes, the special ids, an encoder."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        num_known = min(vocab_size, tokenizer.vocab_size)
        # ids past the tokenizer's vocabulary (padded embedding rows) are empty: never allowed
        self.tokens = [tokenizer.token_bytes(i) for i in range(num_known)] + [b""] * (vocab_size - num_known)
        self.special_token_ids = [i for i in range(num_known) if tokenizer.is_special(i)]
        self.eos_token_id = min(stop_token_ids) if stop_token_ids else tokenizer.eos_id
        self.bos_token_id = getattr(tokenizer, "bos_id", None)
        self._tokenizer = tokenizer
        self._ids: dict[bytes, int] | None = None  # token bytes -> id, for the fallback

    def __call__(self, data: bytes) -> list[int]:
        """Tokens whose bytes are exactly `data` (llguidance tokenizes forced text with this):
        the tokenizer's own encoding when it round-trips, else greedy longest match. Sentencepiece
        adds a dummy-prefix space, and a split multi-byte character does not decode."""
        ids = self._tokenizer.encode(data.decode("utf-8", errors="replace"))
        if b"".join(self.tokens[i] for i in ids if i < len(self.tokens)) == data:
            return ids
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        if self._ids is None:
            special = set(self.special_token_ids)
            self._ids = {}
            for i, token in enumerate(self.tokens):
                if token and i not in special:
                    self._ids.setdefault(token, i)
        longest = max(map(len, self._ids), default=1)
        out: list[int] = []
        pos = 0
        while pos < len(data):
            for length in range(min(longest, len(data) - pos), 0, -1):
                token_id = self._ids.get(data[pos : pos + length])
                if token_id is not None:
                    out.append(token_id)
                    pos += length
                    break
            else:  # a byte no token spells: llguidance then works without forced tokens here
                return out
        return out


class GrammarState:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher", "executor")

    def __init__(self, matcher: Any, executor: Any) -> None:
        self.matcher = matcher
        self.executor = executor

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar did not allow it."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows nothing more (it has taken the end token)."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarCompiler:
    """Compiles GrammarSpecs against one model's vocabulary; thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lltokenizer: Any = None
        self._executor: Any = None

    # ------------------------------------------------------------------ vocabulary
    def _vocabulary(self) -> tuple[Any, Any]:
        """(LLTokenizer, LLExecutor), built on the first constrained request (~1 s at 128k tokens)."""
        with self._lock:
            if self._lltokenizer is None:
                import llguidance

                view = _TokenizerView(self._tokenizer, self.vocab_size, self._stop_token_ids)
                eos = self._stop_token_ids or [view.eos_token_id]
                self._lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=self.vocab_size,
                                                           eos_token=eos)
                self._executor = llguidance.LLExecutor()
            return self._lltokenizer, self._executor

    # ------------------------------------------------------------------ compiling
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled matcher of a spec (cached); InvalidRequest when it cannot be enforced."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        lltokenizer, _ = self._vocabulary()
        matcher = _compile(spec, lltokenizer)
        with self._lock:
            self._cache[spec] = matcher
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    async def prepare(self, spec: GrammarSpec) -> None:
        """Compile on a worker thread, waiting at most compile_timeout_s (the library's fuel limits
        end the work itself soon after); a timeout is a 400."""
        with self._lock:
            if spec in self._cache:
                return
        try:
            await asyncio.wait_for(asyncio.to_thread(self.compile, spec), self.compile_timeout_s)
        except asyncio.TimeoutError:
            raise InvalidRequest(
                f"the {_what(spec)} took longer than {self.compile_timeout_s:g} s to compile; simplify it",
                param=spec.param, code="grammar_too_complex",
            ) from None

    def new_state(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher for one sequence (a copy of the cached compiled one)."""
        template = self.compile(spec)
        _, executor = self._vocabulary()
        return GrammarState(template.deep_copy(), executor)


def _what(spec: GrammarSpec) -> str:
    return {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}.get(spec.kind, "grammar")


def _grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec; ValueError for text that is not what it claims to be."""
    import llguidance

    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        choices = json.loads(spec.source)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if spec.kind == "grammar":
        return llguidance.grammar_from("grammar", spec.source)
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


def _compile(spec: GrammarSpec, lltokenizer: Any) -> Any:
    import llguidance

    what = _what(spec)
    try:
        grammar = _grammar_text(spec)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"invalid {what}: {exc}", param=spec.param, code="invalid_grammar") from None
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits(verbose_errors=False))
    if matcher.is_error():
        raise InvalidRequest(f"this {what} cannot be enforced: {matcher.get_error()}", param=spec.param,
                             code="invalid_grammar")
    return matcher
