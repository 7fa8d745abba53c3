"""Draft-model proposals: a second executor over the draft checkpoint, with its own KV block pool,
run greedily for k steps per round over mirrors of the target's sequences.

A mirror holds the target sequence's committed tokens plus its own drafts. Each round it re-syncs:
tokens past the longest prefix it shares with the target's (rejected drafts) are dropped and
num_computed_tokens is cut back to it, so their K/V is simply overwritten next time (the draft's
pool is private and never prefix-cached). The first forward of a round catches up on whatever the
target committed since (the whole prompt the first time), the next k - 1 are single-token decodes.
All mirrors of a round run in one batch per step. Greedy drafts make q one-hot, which the verifier's
rejection rule expects (engine/spec/verify.py).
"""

from __future__ import annotations

from typing import Any

from engine.core.kv_blocks import BlockPool
from engine.core.sequence import ScheduledBatch, Sequence, SequenceStatus
from engine.types import SamplingParams

_DRAFT_PARAMS = SamplingParams(temperature=0.0)


def common_prefix_length(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of a and b, known to be at least `start`."""
    end = min(len(a), len(b))
    i = min(start, end)
    while i < end and a[i] == b[i]:
        i += 1
    return i


class DraftProposer:
    def __init__(self, runner: Any) -> None:
        self.runner = runner  # engine.executor.executor.ModelExecutor over the draft checkpoint
        self.pool = BlockPool(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self._mirrors: dict[int, Sequence] = {}  # target seq_id -> the draft's copy
        self._committed: dict[int, int] = {}  # target seq_id -> target tokens the mirror held last round

    def propose(self, seqs: list[Sequence], budgets: dict[int, int]) -> dict[int, list[int]]:
        """seq_id -> up to budgets[seq_id] greedy draft tokens, for each of seqs (running decodes)."""
        self.retain(seqs)  # finished, preempted or not speculating now: their draft K/V goes
        if not seqs:
            return {}
        k = max(budgets[seq.seq_id] for seq in seqs)
        mirrors: list[Sequence] = []
        for seq in seqs:
            mirror = self._sync(seq)
            # room for every position a draft step writes: the tokens so far plus k - 1 drafts
            if self.pool.allocate(mirror, mirror.num_tokens + k - 1):
                mirrors.append(mirror)
            else:  # the draft's pool is full: this sequence goes without drafts this round
                self._drop(seq.seq_id)
        for _ in range(k):
            if not mirrors:
                break
            batch = ScheduledBatch(list(mirrors), [m.num_uncomputed_tokens for m in mirrors])
            out = self.runner.execute(batch)
            sampled = dict(zip(out.seq_ids, out.sampled_token_ids))
            for mirror, num_new in zip(batch.seqs, batch.num_new_tokens):
                mirror.num_computed_tokens += num_new
                token = sampled.get(mirror.seq_id)
                if token is None:  # a failed row: stop drafting for it
                    mirrors.remove(mirror)
                else:
                    mirror.token_ids.append(token)
        return {seq.seq_id: self._mirrors[seq.seq_id].token_ids[seq.num_tokens : seq.num_tokens + budgets[seq.seq_id]]
                for seq in seqs if seq.seq_id in self._mirrors}

    def retain(self, seqs: list[Sequence]) -> None:
        """Drop the mirrors (and draft KV blocks) of every sequence not in seqs."""
        if len(self._mirrors) > len(seqs) or any(seq.seq_id not in self._mirrors for seq in seqs):
            live = {seq.seq_id for seq in seqs}
            for seq_id in [s for s in self._mirrors if s not in live]:
                self._drop(seq_id)

    def _sync(self, seq: Sequence) -> Sequence:
        mirror = self._mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = Sequence(seq_id=seq.seq_id, request_id=seq.request_id, token_ids=[], num_prompt_tokens=0,
                              params=_DRAFT_PARAMS, status=SequenceStatus.RUNNING)
            self._mirrors[seq.seq_id] = mirror
        shared = common_prefix_length(mirror.token_ids, seq.token_ids, self._committed.get(seq.seq_id, 0))
        mirror.token_ids = list(seq.token_ids)
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, shared, seq.num_tokens - 1)
        self._committed[seq.seq_id] = seq.num_tokens
        return mirror

    def _drop(self, seq_id: int) -> None:
        mirror = self._mirrors.pop(seq_id, None)
        self._committed.pop(seq_id, None)
        if mirror is not None:
            self.pool.free(mirror)

    def shutdown(self) -> None:
        for seq_id in list(self._mirrors):
            self._drop(seq_id)
        self.runner.shutdown()
