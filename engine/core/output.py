"""One pass per step over the scheduler's events: detokenize, stop strings, deltas, stats.

The scheduler already finished sequences on token-level conditions (stop tokens, max_tokens,
context end, errors); here the text-level one, stop strings, is found by each request's incremental
detokenizer, which never lets text past a stop string out. The caller finishes those sequences in
the scheduler before the next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from engine.core.scheduler import SeqEvent
from engine.core.sequence import Sequence
from engine.types import EngineStats, FinishReason, RequestOutput, TokenLogprob

log = logging.getLogger(__name__)

MAX_OBSERVATIONS = 65536  # per histogram, between two scrapes; the newest are kept


class Detokenizer(Protocol):
    stop_matched: str | None

    def push(self, token_ids: list[int]) -> str: ...

    def finish(self) -> str: ...


DetokenizerFactory = Callable[..., Detokenizer]  # (tokenizer, *, stop, skip_special_tokens)


def decode_for_log(tokenizer: Any, token_ids: list[int]) -> str:
    try:
        return tokenizer.decode(token_ids, skip_special_tokens=False)
    except Exception as exc:  # a debugging aid only; never fail a request over it
        return f"<undecodable: {exc}>"


def default_detokenizer_factory() -> DetokenizerFactory:
    from engine.core.detokenizer import IncrementalDetokenizer  # H4's module; imported when first needed

    return IncrementalDetokenizer


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    detokenizer: Detokenizer
    arrival_time_s: float
    scheduled_time_s: float | None = None  # first scheduled (the end of its queue time)
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None


@dataclass(slots=True)
class StatsCollector:
    """Counters and histogram observations; the core thread writes, /metrics reads and drains."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: dict[str, int] = field(default_factory=dict)
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_OBSERVATIONS))
    tpot_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_OBSERVATIONS))
    itl_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_OBSERVATIONS))  # between two tokens of a request
    e2e_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_OBSERVATIONS))
    queue_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_OBSERVATIONS))  # arrival -> first scheduled
    prefill_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_OBSERVATIONS))  # first scheduled -> first token
    decode_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_OBSERVATIONS))  # first token -> last token
    step_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_OBSERVATIONS))
    batch_size: deque[int] = field(default_factory=lambda: deque(maxlen=MAX_OBSERVATIONS))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_step(self, step_s: float, batch_size: int) -> None:
        with self.lock:
            self.step_s.append(step_s)
            self.batch_size.append(batch_size)

    def drain_into(self, stats: EngineStats) -> EngineStats:
        with self.lock:
            stats.prompt_tokens_total = self.prompt_tokens_total
            stats.generation_tokens_total = self.generation_tokens_total
            stats.requests_finished_total = dict(self.requests_finished_total)
            stats.observations_ttft_s, stats.observations_tpot_s = list(self.ttft_s), list(self.tpot_s)
            stats.observations_e2e_s, stats.observations_step_s = list(self.e2e_s), list(self.step_s)
            stats.observations_batch_size = list(self.batch_size)
            stats.observations_queue_s, stats.observations_prefill_s = list(self.queue_s), list(self.prefill_s)
            stats.observations_decode_s, stats.observations_itl_s = list(self.decode_s), list(self.itl_s)
            for observations in (self.ttft_s, self.tpot_s, self.e2e_s, self.step_s, self.batch_size, self.queue_s,
                                 self.prefill_s, self.decode_s, self.itl_s):
                observations.clear()
        return stats


class OutputProcessor:
    def __init__(
        self, tokenizer: Any, *, detokenizer_factory: DetokenizerFactory | None = None, debug_log_io: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.debug_log_io = debug_log_io
        self._make_detokenizer = detokenizer_factory
        self._requests: dict[str, RequestState] = {}
        self.stats = StatsCollector()

    def add(self, seq: Sequence) -> None:
        if self._make_detokenizer is None:
            self._make_detokenizer = default_detokenizer_factory()
        params = seq.params
        detokenizer = self._make_detokenizer(
            self.tokenizer, stop=params.stop, skip_special_tokens=params.skip_special_tokens
        )
        self._requests[seq.request_id] = RequestState(seq, detokenizer, seq.arrival_time_s)

    def mark_scheduled(self, seqs: list[Sequence], now_s: float | None = None) -> None:
        """Note when each request is first scheduled: its queue time ends, its prefill starts."""
        now_s = time.monotonic() if now_s is None else now_s
        for seq in seqs:
            state = self._requests.get(seq.request_id)
            if state is not None and state.scheduled_time_s is None:
                state.scheduled_time_s = now_s
                with self.stats.lock:
                    self.stats.queue_s.append(now_s - state.arrival_time_s)

    def discard(self, request_id: str) -> None:
        """Forget a request that never reached the scheduler."""
        self._requests.pop(request_id, None)

    def process(self, events: list[SeqEvent], now_s: float | None = None) -> tuple[list[RequestOutput], list[Sequence]]:
        """Turn one step's events into one delta per request. Returns the deltas and the sequences
        a stop string finished (still running in the scheduler, to be finished by the caller)."""
        now_s = time.monotonic() if now_s is None else now_s
        outputs: list[RequestOutput] = []
        stopped: list[Sequence] = []
        for event in events:
            state = self._requests.get(event.seq.request_id)
            if state is None:
                continue
            output = self._delta(state, event, now_s)
            if output.finish_reason == "stop" and event.finish_reason is None:
                stopped.append(event.seq)
            if output.finished:
                self._finish(state, output, now_s)
            outputs.append(output)
        return outputs, stopped

    def abort(self, seq: Sequence, reason: FinishReason = "abort", error: str | None = None) -> RequestOutput | None:
        """The final delta for a request that ends outside a step (aborted, or failed on add)."""
        state = self._requests.get(seq.request_id)
        if state is None:
            return None
        output = self._output(seq, [], "", finish_reason=reason, error=error)
        self._finish(state, output, time.monotonic())
        return output

    def _delta(self, state: RequestState, event: SeqEvent, now_s: float) -> RequestOutput:
        seq = state.seq
        if event.new_token_id is None:
            if event.finish_reason == "length":  # max_tokens=0: the prompt pass ended it, no token
                self._observe_prompt(state, now_s)
            output = self._output(seq, [], "", finish_reason=event.finish_reason, error=event.error)
            output.prompt_logprobs = event.prompt_logprobs
            return output
        self._observe_token(state, now_s)
        finish_reason, stop_reason = event.finish_reason, event.stop_reason
        detokenizer = state.detokenizer
        if isinstance(stop_reason, int):
            text = detokenizer.finish()  # a stop token is not part of the text
        else:
            text = detokenizer.push([event.new_token_id])
            if detokenizer.stop_matched is not None:  # push() held back the stop string and what follows
                finish_reason, stop_reason = "stop", detokenizer.stop_matched
            elif finish_reason is not None:
                text += detokenizer.finish()
        logprobs = [event.logprob] if seq.params.logprobs is not None and event.logprob is not None else None
        output = self._output(seq, [event.new_token_id], text, logprobs, finish_reason, stop_reason)
        output.prompt_logprobs = event.prompt_logprobs
        if event.num_output_tokens is not None:  # one of several tokens of a speculative step
            output.num_output_tokens = event.num_output_tokens
        return output

    @staticmethod
    def _output(
        seq: Sequence,
        token_ids: list[int],
        text: str,
        logprobs: list[TokenLogprob] | None = None,
        finish_reason: FinishReason | None = None,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=token_ids,
            text_delta=text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
        )

    def _observe_token(self, state: RequestState, now_s: float) -> None:
        with self.stats.lock:
            self.stats.generation_tokens_total += 1
            if state.first_token_time_s is None:
                state.first_token_time_s = now_s
                self.stats.prompt_tokens_total += state.seq.num_prompt_tokens
                self.stats.ttft_s.append(now_s - state.arrival_time_s)
                if state.scheduled_time_s is not None:
                    self.stats.prefill_s.append(now_s - state.scheduled_time_s)
            elif state.last_token_time_s is not None:
                self.stats.itl_s.append(now_s - state.last_token_time_s)
        state.last_token_time_s = now_s

    def _observe_prompt(self, state: RequestState, now_s: float) -> None:
        """A request that ends after its prompt pass without a token still counts its prompt."""
        with self.stats.lock:
            if state.first_token_time_s is None:
                self.stats.prompt_tokens_total += state.seq.num_prompt_tokens
                self.stats.ttft_s.append(now_s - state.arrival_time_s)

    def _finish(self, state: RequestState, output: RequestOutput, now_s: float) -> None:
        seq = state.seq
        del self._requests[seq.request_id]
        if self.debug_log_io:
            log.info(
                "request %s finished: %s%s output ids=%s text=%r",
                seq.request_id,
                output.finish_reason,
                f" ({output.error})" if output.error else "",
                seq.output_token_ids,
                decode_for_log(self.tokenizer, seq.output_token_ids),
            )
        with self.stats.lock:
            finished = self.stats.requests_finished_total
            finished[output.finish_reason] = finished.get(output.finish_reason, 0) + 1  # type: ignore[index]
            self.stats.e2e_s.append(now_s - state.arrival_time_s)
            num_output = state.seq.num_output_tokens
            if state.first_token_time_s is not None and state.last_token_time_s is not None:
                self.stats.decode_s.append(state.last_token_time_s - state.first_token_time_s)
                if num_output > 1:
                    self.stats.tpot_s.append((state.last_token_time_s - state.first_token_time_s) / (num_output - 1))
