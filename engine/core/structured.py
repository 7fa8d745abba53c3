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
  and a bounded LRU of compiled grammars. Compiles run on its own worker threads, single-flight
  (concurrent requests for one spec wait for one compile) and bounded (every waiter gives up
  compile_timeout_s after that compile started: a slow schema is a 400, never a stalled engine).
  `prepare()` (the event loop) and `compile()` (blocking callers) return a `CompiledGrammar` the
  request holds until admission, so a cache eviction meanwhile drops nothing in use, and the
  engine thread never compiles: `new_state()` only copies.
- `GrammarState` (one per sequence, `Sequence.grammar`): a copy of the compiled matcher. It
  advances only on sampled tokens, so preemption (recompute), prefix-cache hits and n > 1 (one
  state per choice) need nothing special.
- engine/core/sampler.py masks a step's constrained rows, all computed in one call (llguidance's thread
  pool); unconstrained rows are not touched. This module imports neither torch nor numpy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from engine.types import GrammarSpec, InvalidRequest

DEFAULT_CACHE_SIZE = 128  # compiled grammars kept per engine (a compiled matcher is tens of KB)
DEFAULT_COMPILE_TIMEOUT_S = 10.0
COMPILE_WORKERS = 4  # distinct specs compiling at once per engine; llguidance's fuel limits bound each
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


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A spec compiled against one vocabulary: the matcher every sequence's state is copied from. A
    request holds it from preparation to admission, so evicting it from the cache drops nothing in use."""

    spec: GrammarSpec
    matcher: Any  # llguidance.LLMatcher, never advanced itself


@dataclass(frozen=True, slots=True)
class _Compiling:
    """One compile in flight, shared by every request for its spec."""

    future: concurrent.futures.Future  # of CompiledGrammar
    deadline_s: float  # time.monotonic() when every waiter gives up, however late it came


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
        self._lock = threading.Lock()  # guards _cache and _compiling; held only for dict work
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._compiling: dict[GrammarSpec, _Compiling] = {}
        self._workers = concurrent.futures.ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="grammar-compile")
        self._vocabulary_lock = threading.Lock()  # building the vocabulary takes ~1 s: not under _lock
        self._lltokenizer: Any = None
        self._executor: Any = None

    # ------------------------------------------------------------------ vocabulary
    def _vocabulary(self) -> tuple[Any, Any]:
        """(LLTokenizer, LLExecutor), built on the first constrained request (~1 s at 128k tokens)."""
        with self._vocabulary_lock:
            if self._lltokenizer is None:
                import llguidance

                view = _TokenizerView(self._tokenizer, self.vocab_size, self._stop_token_ids)
                eos = self._stop_token_ids or [view.eos_token_id]
                self._lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=self.vocab_size,
                                                           eos_token=eos)
                self._executor = llguidance.LLExecutor()
            return self._lltokenizer, self._executor

    # ------------------------------------------------------------------ compiling
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of a spec, blocking (tests, benchmarks, EngineCore.add_request);
        InvalidRequest when it cannot be enforced or took longer than compile_timeout_s."""
        found = self._cached_or_compiling(spec)
        if isinstance(found, CompiledGrammar):
            return found
        try:
            return found.future.result(timeout=max(0.0, found.deadline_s - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise self._too_slow(spec) from None

    async def prepare(self, spec: GrammarSpec) -> CompiledGrammar:
        """compile() for the event loop: it awaits the shared compile, never blocking the loop."""
        found = self._cached_or_compiling(spec)
        if isinstance(found, CompiledGrammar):
            return found
        if not await _finished_within(found.future, found.deadline_s - time.monotonic()):
            raise self._too_slow(spec)
        return found.future.result()

    def new_state(self, grammar: CompiledGrammar) -> GrammarState:
        """A fresh matcher for one sequence: a copy of the compiled one, never a compile (the engine thread calls it)."""
        _, executor = self._vocabulary()
        return GrammarState(grammar.matcher.deep_copy(), executor)

    def _cached_or_compiling(self, spec: GrammarSpec) -> CompiledGrammar | _Compiling:
        """The cached grammar, else the compile in flight for spec, started here if there is none."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
            compiling = self._compiling.get(spec)
            if compiling is None:
                future = self._workers.submit(self._compile_into_cache, spec)
                compiling = _Compiling(future, time.monotonic() + self.compile_timeout_s)
                self._compiling[spec] = compiling
            return compiling

    def _compile_into_cache(self, spec: GrammarSpec) -> CompiledGrammar:
        """A worker's compile: cached (a compile that outlived its waiters still serves the next
        request); a failure is not, so a spec refused once is compiled again when asked again."""
        try:
            lltokenizer, _ = self._vocabulary()
            compiled = CompiledGrammar(spec, _compile(spec, lltokenizer))
        except BaseException:
            with self._lock:
                del self._compiling[spec]
            raise
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            del self._compiling[spec]  # after caching, under one lock: a newcomer finds one or the other
        return compiled

    def _too_slow(self, spec: GrammarSpec) -> InvalidRequest:
        return InvalidRequest(f"the {_what(spec)} took longer than {self.compile_timeout_s:g} s to compile; simplify it",
                              param=spec.param, code="grammar_too_complex")


async def _finished_within(future: concurrent.futures.Future, timeout_s: float) -> bool:
    """Whether a worker's future finished within timeout_s. Waiting never cancels it: other requests
    may share it, and a compile cannot be stopped part way anyway."""
    if future.done():
        return True
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()

    def wake(_: concurrent.futures.Future) -> None:
        try:
            loop.call_soon_threadsafe(finished.set)
        except RuntimeError:  # that loop is closed: nobody waits any more
            pass

    future.add_done_callback(wake)
    try:
        await asyncio.wait_for(finished.wait(), max(0.0, timeout_s))
    except asyncio.TimeoutError:
        return False
    return True


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
