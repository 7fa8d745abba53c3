"""Which sequences speculate this step, with which draft tokens, and what came of it (metrics).

EngineCore calls `propose` before scheduling: every running sequence that is about to decode and
whose sampling the verifier reproduces exactly gets up to k draft tokens in seq.spec_token_ids (the
scheduler may cut them to fit the token budget or the KV pool); `record` counts the outcome after
the forward. Sequences that skip speculation and why: logprobs (the verifier computes no logprobs
for accepted tokens), constrained outputs (a grammar must see every token before the next is
masked), penalties, logit_bias, allowed_token_ids, bad words (they change logits token by token),
and min_tokens not reached yet (stop tokens are masked per position). They decode one token per step
beside the speculating ones, in the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.sequence import Sequence, SequenceStatus
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import NgramIndex
from engine.types import SamplingParams


def speculation_supported(seq: Sequence) -> bool:
    """Whether the verifier reproduces this sequence's sampling exactly (see the module docstring)."""
    p: SamplingParams = seq.params
    return (
        p.logprobs is None and seq.grammar is None and not p.logit_bias and p.allowed_token_ids is None
        and not p.bad_words_token_ids and p.presence_penalty == 0 and p.frequency_penalty == 0
        and p.repetition_penalty == 1 and seq.num_output_tokens >= p.min_tokens and not seq.wants_prompt_logprobs
    )


@dataclass(slots=True)
class SpecStats:
    """Cumulative counters, vLLM's spec_decode metrics: drafts (sequence-steps that speculated),
    draft tokens proposed (after the scheduler's cut), accepted tokens, accepted per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [num_speculative_tokens]


class Speculator:
    def __init__(self, config: SpeculativeConfig, *, max_seq_len: int, draft: Any = None) -> None:
        if config.method == "draft_model" and draft is None:
            raise ValueError("draft-model speculation needs the draft model's proposer")
        self.config = config
        self.max_seq_len = max_seq_len
        self.draft = draft  # engine.spec.draft.DraftProposer for method "draft_model"
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._ngrams: dict[int, NgramIndex] = {}  # seq_id -> its n-gram index (method "ngram"), while running

    def budget_for(self, seq: Sequence) -> int:
        """Draft tokens seq may take this step: k, less what max_tokens and the context leave (the
        bonus token after the drafts counts too); 0 when it does not speculate."""
        if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1 or not speculation_supported(seq):
            return 0
        k = min(self.config.num_speculative_tokens, self.max_seq_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(k, 0)

    def propose(self, running: list[Sequence]) -> None:
        """Set spec_token_ids on every running sequence ([] where it does not speculate)."""
        budgets = {seq.seq_id: self.budget_for(seq) for seq in running}
        if self.draft is not None:
            proposals = self.draft.propose([seq for seq in running if budgets[seq.seq_id] > 0], budgets)
            for seq in running:
                seq.spec_token_ids = proposals.get(seq.seq_id, [])
            return
        for seq in running:
            k = budgets[seq.seq_id]
            seq.spec_token_ids = self._ngram_index(seq).propose(seq.token_ids, k) if k else []

    def _ngram_index(self, seq: Sequence) -> NgramIndex:
        index = self._ngrams.get(seq.seq_id)
        if index is None:
            cfg = self.config
            index = self._ngrams[seq.seq_id] = NgramIndex(lookup_min=cfg.prompt_lookup_min, lookup_max=cfg.prompt_lookup_max)
        return index

    def record(self, seqs: list[Sequence], accepted_token_ids: dict[int, list[int]]) -> None:
        """Count one step's outcome: seqs are the batch's, spec_token_ids still as verified."""
        stats = self.stats
        for seq in seqs:
            if not seq.spec_token_ids:
                continue
            num_accepted = len(accepted_token_ids.get(seq.seq_id, ()))
            stats.num_drafts += 1
            stats.num_draft_tokens += len(seq.spec_token_ids)
            stats.num_accepted_tokens += num_accepted
            for position in range(num_accepted):
                stats.accepted_per_position[position] += 1

    def retain(self, running: list[Sequence]) -> None:
        """Release what the proposer holds for sequences no longer running (the draft's KV blocks, the
        n-gram indexes; a preempted sequence rebuilds its index once when it runs again)."""
        if self.draft is not None:
            self.draft.retain(running)
        ngrams = self._ngrams
        if ngrams and (len(ngrams) > len(running) or any(seq.seq_id not in ngrams for seq in running)):
            live = {seq.seq_id for seq in running}
            for seq_id in [s for s in ngrams if s not in live]:
                del ngrams[seq_id]

    def shutdown(self) -> None:
        if self.draft is not None:
            self.draft.shutdown()
