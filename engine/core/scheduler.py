"""Continuous batching: which sequences run this step, and how many of their tokens.

One rule covers prefill, chunked prefill, prefix-cache hits and resume after preemption: every
scheduled sequence gets min(num_tokens - num_computed_tokens, budget left) tokens. Queues are
ordered by (priority, client priority, arrival, seq_id): FCFS among equals, lower values first; the
sequence at the back of the running queue is the one preempted when blocks run out. `priority` is
the level (online, batch); a client's own `priority` (vLLM's field) orders requests within it.
Priority levels are served in turn, most urgent first; within a level running decodes go first so
a long prompt never stalls them, then running prefill chunks, then admissions. So an urgent
(online) prefill takes the token budget before less urgent (batch) work does, and an urgent
request that finds no sequence slot or KV room preempts less urgent running sequences, latest
first, to be admitted at once; a request never preempts one of its own or a more urgent level.
At most config.max_loras distinct LoRA adapters run at once: a waiting sequence of another
adapter stays queued (never refused); base sequences behind it pass, adapter sequences wait too
(so the running adapters drain and it gets its turn).
Waiting sequences are bounded per queue class (engine.config.queue_class): online and batch work
each within their own bound, so a batch filling the queue never refuses an online request.
Plain Python over ints: no torch, no numpy.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from engine.config import EngineConfig, QueueClass, queue_class
from engine.core.kv_blocks import BlockPool
from engine.core.sequence import ScheduledBatch, Sequence, SequenceStatus, StepOutput, ending_token_ids
from engine.types import FinishReason, QueueFull, TokenLogprob


def queue_full(queue: QueueClass, num_waiting: int, bound: int, *, model_id: str | None = None) -> QueueFull:
    """The 429 for a full queue class, naming the class so a batch's refusals read as its own."""
    what = "online sequences" if queue == "online" else "batch sequences"
    where = "" if model_id is None else f" for model {model_id!r}"
    return QueueFull(f"{num_waiting} {what} are already waiting{where} (the limit is {bound}); retry later")


@dataclass(slots=True)
class SeqEvent:
    """What one step did to one sequence: a new token and/or how it finished."""

    seq: Sequence
    new_token_id: int | None  # None for a finish without a token (error)
    logprob: TokenLogprob | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, with the first token (or max_tokens=0 finish)
    num_output_tokens: int | None = None  # the count with this token, when more than one came in a step


def _order(seq: Sequence) -> tuple[int, int, float, int]:
    return (seq.priority, seq.client_priority, seq.arrival_time_s, seq.seq_id)


class Scheduler:
    def __init__(
        self, config: EngineConfig, pool: BlockPool, *, max_seq_len: int, stop_token_ids: frozenset[int]
    ) -> None:
        self.pool = pool
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_batch_size = config.max_batch_size
        self.config = config  # its per-class waiting bounds (max_waiting_sequences)
        self.max_seq_len = max_seq_len
        self.stop_token_ids = stop_token_ids  # the family's EOS/EOT/EOM ids
        self.waiting: list[Sequence] = []  # sorted by _order
        self.running: list[Sequence] = []  # sorted by _order; the last one is preempted first
        self._by_request: dict[str, Sequence] = {}
        # Sequences in `waiting` per queue class, kept as ints: the event loop reads them to refuse early.
        self._num_waiting_by_class: dict[QueueClass, int] = {"online": 0, "batch": 0}
        self.num_preempted_total = 0
        self.num_preempted_by_priority: dict[int, int] = {}  # priority -> preemptions, for /metrics

    # ------------------------------------------------------------------ queues
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_waiting_in(self, queue: QueueClass) -> int:
        """Waiting sequences (new and preempted) of one queue class; safe to read from another thread."""
        return self._num_waiting_by_class[queue]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_request.get(request_id)

    def add(self, seq: Sequence) -> None:
        queue = queue_class(seq.priority)
        num_waiting, bound = self._num_waiting_by_class[queue], self.config.max_waiting_sequences(queue)
        if num_waiting >= bound:
            raise queue_full(queue, num_waiting, bound)
        if seq.request_id in self._by_request:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        seq.status = SequenceStatus.WAITING
        seq.stop_token_ids = ending_token_ids(seq.params, self.stop_token_ids)
        self._enqueue(seq)
        self._by_request[seq.request_id] = seq

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_order)
        self._num_waiting_by_class[queue_class(seq.priority)] += 1

    def _dequeue(self, index: int) -> Sequence:
        seq = self.waiting.pop(index)
        self._num_waiting_by_class[queue_class(seq.priority)] -= 1
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request in any phase and free its blocks; None if it is not here (finished)."""
        seq = self._by_request.get(request_id)
        if seq is not None:
            self.finish(seq)
        return seq

    def finish(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self._dequeue(self.waiting.index(seq))
        else:
            return
        self.pool.free(seq)
        seq.status = SequenceStatus.FINISHED
        del self._by_request[seq.request_id]

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(seqs=[], num_new_tokens=[])
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        may_admit = True
        urgent_prefill = False
        for level in sorted({s.priority for s in self.running} | {s.priority for s in self.waiting}):
            preempted_before = self.num_preempted_total
            # While a more urgent level prefills, less urgent ones only decode: their prefill
            # chunks would lengthen the step that brings the urgent request's first token.
            budget = self._schedule_running(batch, budget, scheduled, level, decodes_only=urgent_prefill)
            # Admitting while preempting would only thrash; and a level's head that could not be
            # admitted keeps every less urgent request out too (FCFS within and across levels).
            may_admit = may_admit and not urgent_prefill and self.num_preempted_total == preempted_before
            if may_admit:
                budget, may_admit = self._admit(batch, budget, level)
                may_admit = may_admit and self.num_preempted_total == preempted_before
            urgent_prefill = any(seq.num_uncomputed_tokens > 1 for seq in batch.seqs)
        return batch

    def _schedule_running(
        self, batch: ScheduledBatch, budget: int, scheduled: set[int], level: int, *, decodes_only: bool
    ) -> int:
        """Schedule the running sequences of one priority level, decodes first; the budget left."""
        for decodes in (True,) if decodes_only else (True, False):  # prefill chunks take what budget is left
            for seq in list(self.running):
                if len(batch.seqs) >= self.max_batch_size or budget == 0:
                    break
                if seq.priority != level or seq.status is not SequenceStatus.RUNNING:
                    continue
                if (seq.num_uncomputed_tokens == 1) != decodes:
                    continue
                num_new = min(seq.num_uncomputed_tokens, budget if decodes else self._chunk_room(batch, budget, seq))
                num_spec = self._room_for_drafts(seq, budget - num_new) if decodes else 0
                if not self._make_room(seq, seq.num_computed_tokens + num_new, scheduled):
                    continue
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                scheduled.add(seq.seq_id)
                budget = max(0, budget - num_new - num_spec)
        return budget

    def _chunk_room(self, batch: ScheduledBatch, budget: int, seq: Sequence) -> int:
        """Tokens seq's prompt chunk may take now: the budget left, or, as the first thing in a step that
        has nothing else to run, up to max_prefill_chunk_tokens (a lone long prompt in fewer, larger steps;
        with decodes running the budget holds, so their inter-token latency does not grow). Not for a
        prompt whose logprobs are asked: each of its chunk's rows gets full-vocabulary logits (a 2048-row
        chunk of a 128K vocabulary: 1 GiB of float32), so it keeps the budget's bound on that memory."""
        if batch.seqs or seq.wants_prompt_logprobs or any(s.num_uncomputed_tokens == 1 for s in self.running):
            return budget
        return max(budget, self.config.max_prefill_chunk_tokens)

    def _room_for_drafts(self, seq: Sequence, budget: int) -> int:
        """Cut seq's draft tokens (speculative decoding) to the token budget and to the KV room there is
        without preempting anyone for a guess; how many it keeps."""
        num_spec = min(len(seq.spec_token_ids), budget)
        if num_spec and not self.pool.allocate(seq, seq.num_tokens + num_spec):
            num_spec = 0
        del seq.spec_token_ids[num_spec:]
        return num_spec

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Allocate blocks for seq, preempting from the back of the running queue until they fit.
        False when seq itself had to go."""
        while not self.pool.allocate(seq, num_tokens):
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
            if victim is None:  # cannot happen while max_seq_len <= pool capacity; keep it safe anyway
                victim = seq
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq)
        seq.spec_token_ids = []
        seq.num_computed_tokens = 0  # recomputed on resume (a prefix-cache hit may skip part of it)
        if seq.wants_prompt_logprobs:  # not delivered yet: the recompute starts them over
            seq.prompt_logprobs = None
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preempted_total += 1
        self.num_preempted_by_priority[seq.priority] = self.num_preempted_by_priority.get(seq.priority, 0) + 1
        self._enqueue(seq)

    def _admit(self, batch: ScheduledBatch, budget: int, level: int) -> tuple[int, bool]:
        """Admit waiting sequences of one priority level in order; the budget left, and False when
        the level's head had to stay (so nothing less urgent may pass it)."""
        index = 0
        adapters = {s.lora_id for s in self.running if s.lora_id}
        adapter_waits = False  # an adapter sequence ahead waits for a free adapter slot
        while index < len(self.waiting) and self.waiting[index].priority == level:
            if budget == 0 or len(batch.seqs) >= self.max_batch_size:
                return budget, False
            seq = self.waiting[index]
            if seq.lora_id and (adapter_waits or (seq.lora_id not in adapters and len(adapters) >= self.config.max_loras)):
                # Its adapter waits for one of the max_loras running ones to finish; base sequences behind
                # it pass, adapter ones do not (not even of a running adapter), so the running adapters drain
                # and the waiting one gets its turn instead of starving behind a steady stream.
                adapter_waits = True
                index += 1
                continue
            cached = self._room_for(seq)
            if cached is None:
                return budget, False
            num_cached = len(cached) * self.pool.block_size
            num_new = min(seq.num_tokens - num_cached, self._chunk_room(batch, budget, seq))
            if not self.pool.allocate(seq, num_cached + num_new, cached):
                return budget, False
            self._dequeue(index)
            if seq.lora_id:
                adapters.add(seq.lora_id)
            if not seq.wants_prompt_logprobs:
                self.pool.record_prefix_lookup(seq.num_tokens, num_cached)
            if seq.status is SequenceStatus.WAITING:  # first admission: report cache use of the prompt
                seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_order)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget = max(0, budget - num_new)
        return budget, True

    def _room_for(self, seq: Sequence) -> list[int] | None:
        """A sequence slot and KV room for all of seq, preempting less urgent running sequences
        (latest first) when it lacks them; seq's cached prefix blocks, or None if it must wait.

        Admission asks room for the whole rest of the sequence, so prefill chunks of a newly
        admitted request do not immediately preempt others. Less urgent sequences that run are
        never scheduled yet in this step (levels run most urgent first), so preempting them is safe."""
        while True:
            # Prompt logprobs need every prompt row's logits, so such a prompt computes in full
            # (its blocks are still registered for others once computed).
            cached = [] if seq.wants_prompt_logprobs else self.pool.find_cached_prefix(seq)
            has_slot = len(self.running) < self.max_batch_size
            if has_slot and self.pool.can_allocate(seq, seq.num_tokens, cached):
                return cached
            victim = self.running[-1] if self.running else None
            if victim is None or victim.priority <= seq.priority:
                return None
            if not self._frees_enough(seq, cached):
                return None  # preempting every less urgent sequence would not make room: keep them
            self._preempt(victim)

    def _frees_enough(self, seq: Sequence, cached: list[int]) -> bool:
        """Whether preempting every running sequence less urgent than seq frees KV room for it
        (blocks they share with others or with seq's cached prefix are not counted)."""
        held: dict[int, int] = {}
        for other in self.running:
            if other.priority > seq.priority:
                for block_id in other.block_table:
                    held[block_id] = held.get(block_id, 0) + 1
        freeable = sum(1 for block_id, n in held.items()
                       if n == self.pool.ref_count(block_id) and block_id not in cached)
        return self.pool.num_blocks_to_allocate(seq, seq.num_tokens, cached) <= self.pool.num_free + freeable

    # ------------------------------------------------------------------ update
    def update(self, batch: ScheduledBatch, output: StepOutput) -> list[SeqEvent]:
        """Advance the batch's sequences by what the runner computed; append sampled tokens;
        finish sequences on errors, stop tokens, max_tokens and context end."""
        sampled = {seq_id: i for i, seq_id in enumerate(output.seq_ids)}
        events: list[SeqEvent] = []
        for i, seq in enumerate(batch.seqs):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            expects_token = batch.samples(i)
            score_only = expects_token and seq.params.max_tokens == 0 and seq.num_output_tokens == 0
            error = output.errors.get(seq.seq_id)
            if error is None and expects_token and not score_only and seq.seq_id not in sampled:
                error = "the model runner returned no token for this sequence"
            if error is None and seq.wants_prompt_logprobs:
                error = self._collect_prompt_logprobs(seq, batch.num_new_tokens[i], output)
            if error is not None:
                self.finish(seq)
                events.append(SeqEvent(seq, None, finish_reason="error", error=error))
                continue
            if seq.spec_token_ids:
                events += self._commit_speculative(seq, batch.num_new_tokens[i], output, sampled)
                continue
            seq.num_computed_tokens += batch.num_new_tokens[i]
            self.pool.cache_computed_blocks(seq)
            if not expects_token:
                continue  # a partial prefill chunk
            prompt_logprobs = self._take_prompt_logprobs(seq)
            if score_only:  # max_tokens=0: the prompt pass was the whole job; nothing is generated
                self.finish(seq)
                events.append(SeqEvent(seq, None, finish_reason="length", prompt_logprobs=prompt_logprobs))
                continue
            j = sampled[seq.seq_id]
            token_id = output.sampled_token_ids[j]
            seq.token_ids.append(token_id)
            event = SeqEvent(seq, token_id, output.logprobs[j] if j < len(output.logprobs) else None)
            event.prompt_logprobs = prompt_logprobs
            if seq.grammar is not None and not seq.grammar.accept(token_id):  # the mask should make this impossible
                event.finish_reason, event.error = "error", f"token {token_id} broke the grammar: {seq.grammar.error}"
                self.finish(seq)
                events.append(event)
                continue
            self._check_stop(event)
            if event.finish_reason is not None:
                self.finish(seq)
            events.append(event)
        return events

    def _commit_speculative(self, seq: Sequence, num_new: int, output: StepOutput, sampled: dict[int, int]) -> list[SeqEvent]:
        """A speculating sequence's step: its accepted drafts, then the sampled token, one event each,
        up to the first that ends it (stop token, max_tokens, context end). Only the accepted drafts'
        K/V counts as computed (the sampled token's is not written yet); blocks allocated for the
        rejected ones go back, and the prefix cache hashes committed tokens only."""
        tokens = [*output.accepted_token_ids.get(seq.seq_id, ()), output.sampled_token_ids[sampled[seq.seq_id]]]
        seq.spec_token_ids = []
        events: list[SeqEvent] = []
        for token_id in tokens:
            seq.token_ids.append(token_id)
            event = SeqEvent(seq, token_id, num_output_tokens=seq.num_output_tokens)
            self._check_stop(event)
            events.append(event)
            if event.finish_reason is not None:
                self.finish(seq)
                return events
        seq.num_computed_tokens += num_new + len(tokens) - 1
        self.pool.cache_computed_blocks(seq)
        self.pool.trim(seq, seq.num_tokens)
        return events

    @staticmethod
    def _collect_prompt_logprobs(seq: Sequence, num_new: int, output: StepOutput) -> str | None:
        """Append this chunk's prompt logprobs to seq's; an error message if the runner's count is off."""
        start = seq.num_computed_tokens
        expected = max(0, min(start + num_new + 1, seq.num_prompt_tokens) - (start + 1))
        got = output.prompt_logprobs.get(seq.seq_id, [])
        if len(got) != expected:
            return f"the model runner returned {len(got)} prompt logprobs where {expected} were due"
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]  # the first token: nothing precedes it
        seq.prompt_logprobs.extend(got)
        return None

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> list[TokenLogprob | None] | None:
        """Hand out seq's prompt logprobs once, when its prompt pass completes."""
        if not seq.wants_prompt_logprobs:
            return None
        collected, seq.prompt_logprobs = seq.prompt_logprobs, None
        seq.prompt_logprobs_delivered = True
        return collected

    def fail(self, batch: ScheduledBatch, error: str) -> list[SeqEvent]:
        """The whole step failed: finish the batch's sequences with an error event each."""
        events = []
        for seq in batch.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                self.finish(seq)
                events.append(SeqEvent(seq, None, finish_reason="error", error=error))
        return events

    def _check_stop(self, event: SeqEvent) -> None:
        seq, token_id, params = event.seq, event.new_token_id, event.seq.params
        if seq.num_output_tokens > params.min_tokens and token_id in seq.stop_token_ids:  # only past min_tokens
            event.finish_reason, event.stop_reason = "stop", token_id
            return
        if seq.grammar is not None and seq.grammar.terminated:  # complete, and nothing may follow: the text ends
            event.finish_reason = "stop"  # the token is text (a stop token returned above)
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            event.finish_reason = "length"
        elif seq.num_tokens >= self.max_seq_len:
            event.finish_reason = "length"
