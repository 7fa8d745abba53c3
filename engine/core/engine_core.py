"""The synchronous engine: requests in, one model step at a time, deltas out.

`step()` is schedule -> execute -> update; adds and aborts happen between steps (the async engine
applies them before calling step), detokenization and stats after. Single-threaded by design: only
the engine thread calls into a core; `stats()` is the one method safe from other threads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.core.kv_blocks import BlockPool
from engine.core.output import DetokenizerFactory, OutputProcessor, decode_for_log
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.structured import CompiledGrammar, GrammarCompiler
from engine.lora.table import AdapterTable
from engine.spec.config import SpeculativeConfig
from engine.spec.draft import DraftProposer
from engine.spec.speculator import Speculator
from engine.types import (
    EngineDead, EngineRequest, EngineStats, InvalidRequest, RequestOutput, check_context_length,
    check_token_ids, request_id_in_use,
)

if TYPE_CHECKING:
    from engine.executor.executor import Executor

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepTiming:
    """Cumulative wall time per phase, to tell model time from bookkeeping (bench/throughput.py)."""

    num_steps: int = 0
    schedule_s: float = 0.0
    execute_s: float = 0.0
    update_s: float = 0.0  # scheduler.update + output processing + stats

    @property
    def bookkeeping_fraction(self) -> float:
        total = self.schedule_s + self.execute_s + self.update_s
        return (self.schedule_s + self.update_s) / total if total else 0.0


def check_request(request: EngineRequest, *, max_seq_len: int, vocab_size: int) -> None:
    """The engine's guard against a request it cannot serve (InvalidRequest / ContextLengthExceeded):
    compat has checked the request already, with the same functions (engine.types). Cheap and side
    effect free; it runs once per request, in `EngineCore.check` (the async engine calls that on the
    caller's side before queueing, then admits the request on the engine thread)."""
    if not request.prompt_token_ids:
        raise InvalidRequest("the prompt is empty: at least one token is needed", param="prompt")
    check_token_ids(request.prompt_token_ids, vocab_size, "prompt")
    request.params.validate(vocab_size)
    check_context_length(len(request.prompt_token_ids), request.params.max_tokens, max_seq_len)
    for placement in request.images:  # the executor fills exactly these rows (engine/executor/images.py)
        if placement.offset < 0 or placement.length < 1 or placement.offset + placement.length > len(request.prompt_token_ids):
            raise InvalidRequest("an image's tokens lie outside the prompt", param=placement.image.param)


def new_speculator(config: SpeculativeConfig | None, max_seq_len: int, draft_runner: Executor | None,
                   vocab_size: int) -> Speculator | None:
    """The engine's speculator for its config: prompt lookup, or a draft model over draft_runner."""
    if config is None:
        return None
    if config.method == "draft_model":
        if draft_runner is None:
            raise ValueError(f"speculative_config names draft model {config.model!r} but no draft runner was loaded")
        if draft_runner.vocab_size != vocab_size:
            raise InvalidRequest(f"draft model {config.model!r} has a vocabulary of {draft_runner.vocab_size} tokens, "
                                 f"the target {vocab_size}: a draft needs the same tokenizer",
                                 param="speculative_config.model")
        return Speculator(config, max_seq_len=max_seq_len, draft=DraftProposer(draft_runner))
    return Speculator(config, max_seq_len=max_seq_len)


def adapter_not_loaded(name: str) -> InvalidRequest:
    return InvalidRequest(f"LoRA adapter {name!r} is not loaded on this engine", param="model", code="model_not_found")


class EngineCore:
    def __init__(
        self,
        runner: Executor,
        tokenizer: Any,
        config: EngineConfig,
        max_seq_len: int,
        *,
        detokenizer_factory: DetokenizerFactory | None = None,
        draft_runner: Executor | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = runner.vocab_size
        self.pool = BlockPool(runner.num_blocks, runner.block_size, enable_prefix_caching=config.enable_prefix_caching)
        # A sequence must fit in the pool alone, or preempting everyone else could not make room for it.
        self.max_seq_len = min(max_seq_len, runner.num_blocks * runner.block_size)
        stop_ids = frozenset(getattr(tokenizer, "stop_token_ids", ()))  # the one source of the family's stop ids
        self.scheduler = Scheduler(config, self.pool, max_seq_len=self.max_seq_len, stop_token_ids=stop_ids)
        self.output = OutputProcessor(
            tokenizer, detokenizer_factory=detokenizer_factory, debug_log_io=config.debug_log_io
        )
        self.timing = StepTiming()
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, stop_ids)  # llguidance loads on first use
        self._next_seq_id = 0
        self.adapters = AdapterTable()  # LoRA adapters loaded on this engine (engine/lora/table.py)
        # Speculative decoding (engine/spec/): None when config.speculative_config is off
        self.speculator = new_speculator(config.speculative_config, self.max_seq_len, draft_runner, self.vocab_size)

    # ------------------------------------------------------------------ requests
    def check(self, request: EngineRequest) -> None:
        """Whether this engine can serve the request at all; pure (reads only immutable limits)."""
        check_request(request, max_seq_len=self.max_seq_len, vocab_size=self.vocab_size)
        if request.lora_name is not None and request.lora_name not in self.adapters.ids:
            raise adapter_not_loaded(request.lora_name)

    def add_request(self, request: EngineRequest) -> None:
        """Check, compile its grammar (blocking, bounded) and queue a request; raises InvalidRequest,
        ContextLengthExceeded or QueueFull. The async engine compiles on the event loop's side instead."""
        self.check(request)
        spec = request.params.grammar
        self.admit(request, None if spec is None else self.grammars.compile(spec))

    def admit(self, request: EngineRequest, grammar: CompiledGrammar | None = None) -> None:
        """Queue a request that `check` passed, with the grammar prepared for it if it is constrained
        (held since then, so a cache eviction cannot make this compile); raises InvalidRequest (its id
        is in use) or QueueFull."""
        if self.scheduler.get(request.request_id) is not None:
            raise request_id_in_use(request.request_id)
        if (request.params.grammar is None) != (grammar is None):
            raise ValueError(f"request {request.request_id!r}: a constrained request is admitted with its "
                             "prepared grammar, an unconstrained one without")
        seq = Sequence(
            seq_id=self._next_seq_id,
            request_id=request.request_id,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            params=request.params,
            arrival_time_s=request.arrival_time_s,
            priority=request.priority,
            client_priority=request.client_priority,
            images=request.images,
        )
        if request.lora_name is not None:
            lora_id = self.adapters.ids.get(request.lora_name)
            if lora_id is None:  # unloaded since generate() checked it
                raise adapter_not_loaded(request.lora_name)
            seq.lora_id = lora_id
            self.adapters.requests_total[request.lora_name] = self.adapters.requests_total.get(request.lora_name, 0) + 1
        if grammar is not None:
            seq.grammar = self.grammars.new_state(grammar)  # a copy; the engine thread never compiles
        self.output.add(seq)
        try:
            self.scheduler.add(seq)  # QueueFull
        except BaseException:
            self.output.discard(seq.request_id)
            raise
        self._next_seq_id += 1
        if self.config.debug_log_io:
            text = decode_for_log(self.tokenizer, seq.token_ids)
            log.info("request %s prompt ids=%s text=%r", seq.request_id, seq.token_ids, text)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Remove a request in any phase and free its blocks; None if it already finished."""
        seq = self.scheduler.abort(request_id)
        self._release_finished()
        return None if seq is None else self._final(seq, "abort")

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every request with an error (the runner died); frees all blocks."""
        seqs = [*self.scheduler.running, *self.scheduler.waiting]
        for seq in seqs:
            self.scheduler.finish(seq)
        return [out for seq in seqs if (out := self._final(seq, "error", error)) is not None]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One model step over the current batch; the deltas it produced, one per request."""
        if not self.scheduler.has_work:
            return []
        started_s = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        scheduled_s = time.perf_counter()
        self.output.mark_scheduled(batch.seqs)
        try:
            out = self.runner.execute(batch)
        except EngineDead:
            raise
        except Exception as exc:  # the step failed as a whole: fail its requests, keep serving
            log.exception("model step over %d sequences failed", len(batch.seqs))
            executed_s = time.perf_counter()
            events = self.scheduler.fail(batch, f"model step failed: {type(exc).__name__}: {exc}")
        else:
            executed_s = time.perf_counter()
            if self.speculator is not None:
                self.speculator.record(batch.seqs, out.accepted_token_ids)
            events = self.scheduler.update(batch, out)
        outputs, stopped = self.output.process(events)
        for seq in stopped:  # stop strings, found in the text
            self.scheduler.finish(seq)
        self._release_finished()
        done_s = time.perf_counter()
        self._record_timing(started_s, scheduled_s, executed_s, done_s, len(batch.seqs))
        return outputs

    def _release_finished(self) -> None:
        """Per-sequence state kept beside the KV blocks (Llama 3.2 Vision's cross-attention states in
        the executor, a draft model's copies of the sequences), dropped as soon as its sequence is
        finished, aborted or preempted, not at the next step (which may not come). Executors without
        such state (text models' fakes included) have no release_finished."""
        release = getattr(self.runner, "release_finished", None)
        if release is not None:
            release()
        if self.speculator is not None:
            self.speculator.retain(self.scheduler.running)

    def _record_timing(self, started_s: float, scheduled_s: float, executed_s: float, done_s: float, size: int) -> None:
        timing = self.timing
        timing.num_steps += 1
        timing.schedule_s += scheduled_s - started_s
        timing.execute_s += executed_s - scheduled_s
        timing.update_s += done_s - executed_s
        self.output.stats.record_step(done_s - started_s, size)

    def _final(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput | None:
        return self.output.abort(seq, reason, error)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ LoRA adapters (engine thread)
    def load_adapter(self, name: str, adapter: Any, path: str) -> int:
        """Install a read adapter (engine.lora.adapters.LoraAdapter) under `name` on every rank; a
        name loaded already is swapped: running sequences finish on the old weights. Bytes held."""
        lora_id = self.adapters.new_id()
        num_bytes = self.runner.load_adapter(lora_id, adapter, path)  # type: ignore[attr-defined]
        self.adapters.bind(name, lora_id, num_bytes)
        self.release_adapters()
        return num_bytes

    def unload_adapter(self, name: str) -> bool:
        """Stop serving `name` (its weights go once its running sequences finish); False if unknown."""
        found = self.adapters.unbind(name)
        self.release_adapters()
        return found

    def release_adapters(self) -> None:
        """Unload retired adapter versions no sequence holds any more."""
        if self.adapters.retired:
            in_use = {seq.lora_id for seq in (*self.scheduler.running, *self.scheduler.waiting) if seq.lora_id}
            for lora_id in self.adapters.releasable(in_use):
                self.runner.unload_adapter(lora_id)  # type: ignore[attr-defined]

    def adapter_activity(self) -> tuple[list[str], list[str]]:
        """(running, waiting) adapter names, for vLLM's lora_requests_info; a racy read is fine."""
        names = {lora_id: name for name, lora_id in list(self.adapters.ids.items())}
        running = {names[s.lora_id] for s in list(self.scheduler.running) if s.lora_id in names}
        waiting = {names[s.lora_id] for s in list(self.scheduler.waiting) if s.lora_id in names}
        return sorted(running), sorted(waiting - running)

    def shutdown_speculator(self) -> None:
        """Stop the draft model's executor, if any (the engine's own runner is the caller's)."""
        if self.speculator is not None:
            self.speculator.shutdown()

    # ------------------------------------------------------------------ stats and debugging
    def stats(self) -> EngineStats:
        pool, scheduler = self.pool, self.scheduler
        stats = EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_preempted_total=scheduler.num_preempted_total,
            num_preempted_by_priority=dict(scheduler.num_preempted_by_priority),
            kv_blocks_used=pool.num_used,
            kv_blocks_total=pool.num_blocks,
            prefix_cache_queries_total=pool.prefix_queries_tokens,
            prefix_cache_hits_total=pool.prefix_hits_tokens,
        )
        if self.speculator is not None:
            spec = self.speculator.stats
            stats.spec_decode_num_drafts_total = spec.num_drafts
            stats.spec_decode_num_draft_tokens_total = spec.num_draft_tokens
            stats.spec_decode_num_accepted_tokens_total = spec.num_accepted_tokens
            stats.spec_decode_num_accepted_tokens_per_pos = list(spec.accepted_per_position)
        return self.output.stats.drain_into(stats)
