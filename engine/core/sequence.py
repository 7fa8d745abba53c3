"""A sequence: ids plus int counters plus a block table. Plain Python; the scheduler, the block
pool and the runner all read it, and only the scheduler writes it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.types import ImagePlacement, SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, blocks freed, recomputed on resume
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time_s: float = 0.0
    priority: int = 0
    client_priority: int = 0  # within the level (EngineRequest.client_priority)
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache; one rule schedules them all
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache on admission
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Prefix-cache bookkeeping (engine/core/kv_blocks.py): chained hashes of the full blocks of
    # token_ids, valid across preemption since they depend only on the tokens, and how many leading
    # blocks of block_table are registered in the cache already.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_preemptions: int = 0
    # Prompt logprobs (params.prompt_logprobs): collected chunk by chunk while the prompt is first
    # computed, handed out once with the first output; after that a recompute (preemption) skips them.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_delivered: bool = False
    # Constrained decoding (engine/core/structured.py GrammarState), None when unconstrained. It advances
    # only on sampled tokens, so it stays valid through preemption and prefix-cache hits.
    grammar: Any = None
    # The tokens that end this sequence past min_tokens (and that the sampler holds back before):
    # set once by the scheduler on admission (ending_token_ids), read by the scheduler and the sampler.
    stop_token_ids: frozenset[int] = frozenset()
    # The engine's LoRA id of the adapter this sequence runs with (0: the base alone); it keys the
    # prefix cache too, so no two adapters (or an adapter and the base) share KV blocks.
    lora_id: int = 0
    # The prompt's images and the spans their tokens fill (EngineRequest.images): the executor puts
    # their embeddings on those rows (Llama 4) or their cross-attention states beside the sequence
    # (Llama 3.2 Vision, engine/executor/cross_attention.py); the block pool keys the prefix hashes of
    # those blocks by them
    images: tuple[ImagePlacement, ...] = ()
    # Speculative decoding (engine/spec/): draft tokens proposed for this step, verified in the same
    # forward as the last committed token. Never part of token_ids: only accepted ones are appended.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while this sequence's prompt logprobs are still to be computed and delivered."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_delivered

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


def ending_token_ids(params: SamplingParams, family_stop_ids: frozenset[int]) -> frozenset[int]:
    """The request's stop_token_ids plus the family's EOS/EOT/EOM ids, unless ignore_eos."""
    requested = frozenset(params.stop_token_ids)
    return requested if params.ignore_eos else requested | family_stop_ids


@dataclass(slots=True)
class ScheduledBatch:
    """What the scheduler hands the runner for one step.

    For sequence i the runner computes tokens token_ids[c : c + n] with c = seqs[i].num_computed_tokens
    and n = num_new_tokens[i] (the scheduler advances num_computed_tokens only after the step), then
    its draft tokens seqs[i].spec_token_ids when it speculates (engine/spec/: more query rows).
    It samples a next token for sequence i iff c + n == seqs[i].num_tokens, i.e. the chunk reaches
    the last known token; a partial prefill chunk samples nothing."""

    seqs: list[Sequence]  # [num_seqs] running decodes first, then prefill chunks
    num_new_tokens: list[int]  # [num_seqs]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


@dataclass(slots=True)
class StepOutput:
    """What the runner hands back: plain lists, never tensors."""

    seq_ids: list[int]  # [num_sampled] sequences that got a token this step, in batch order
    sampled_token_ids: list[int]  # [num_sampled]
    logprobs: list[TokenLogprob | None]  # [num_sampled], None where not asked for
    errors: dict[int, str] = field(default_factory=dict)  # seq_id -> why this sequence alone failed
    # seq_id -> logprobs of prompt tokens [c + 1, min(c + n + 1, num_prompt_tokens)): the rows of this chunk
    # (c, n as in ScheduledBatch), for sequences with wants_prompt_logprobs; empty when none asks.
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    # seq_id -> the leading draft tokens (seq.spec_token_ids) verification accepted; the sampled token
    # follows them (the correction at the first rejection, or the bonus token when all were accepted).
    accepted_token_ids: dict[int, list[int]] = field(default_factory=dict)
