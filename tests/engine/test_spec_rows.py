"""A speculating sequence's verify rows are planned as decodes (engine/executor/executor.py
build_step_inputs): its last token and k drafts are 1 + k query groups of one row over its block
table, lengths ctx + 1 .. ctx + 1 + k, so the backend attends them with its decode kernels (and may
run them through its compiled decode step). Their logits are the logits of the same tokens decoded
one at a time: bit for bit in the batch-invariant mode (row-by-row linears, per-sequence decode
attention), within float32 rounding otherwise. The tiny checkpoint has GQA (4 heads over 2 KV
heads); blocks of 4 tokens put block boundaries inside the drafts."""

from __future__ import annotations

import pytest
import torch

from engine.backends.base import AttentionPath, PagedDecodes, PagedSequences
from engine.core.sequence import ScheduledBatch, Sequence
from engine.executor.executor import build_step_inputs
from engine.executor.step_inputs import query_groups
from engine.types import SamplingParams
from tests.engine.test_model import BLOCK_SIZE, BlockAllocator, all_rows_inputs, make_executor, random_prompts

VOCAB = 256
GREEDY = SamplingParams(temperature=0.0)
# Outside the batch-invariant mode the verify step's linears see 1 + k rows (oneDNN) where a lone
# decode's see one (the one-row kernel): the same float32 dot products of 64 to 176 terms summed in
# another order. Measured: at most ~1.5e-6 on these logits (|logit| < 3); 2e-5 leaves 10x room and
# is still far below any logit gap a wrong key (a rejected draft's K/V seen) would make.
TOLERANCE = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture(scope="module", params=[True, False], ids=["invariant", "default"])
def executor(request, tiny_checkpoint):
    ex = make_executor(tiny_checkpoint, dtype="float32", batch_invariant=request.param)
    ex.invariant = request.param
    yield ex
    ex.shutdown()


class Driver:
    """Sequences on one executor, each with its own (shuffled) blocks."""

    def __init__(self, executor, seed: int = 0) -> None:
        self.executor = executor
        self.alloc = BlockAllocator(executor.num_blocks, seed)
        self.next_id = 0

    def prefilled(self, prompt: list[int]) -> Sequence:
        seq = Sequence(self.next_id, f"r{self.next_id}", list(prompt), len(prompt), GREEDY)
        self.next_id += 1
        self.alloc.grow(seq, len(prompt))
        self.executor.execute(all_rows_inputs(ScheduledBatch([seq], [len(prompt)])))
        seq.num_computed_tokens = len(prompt)
        return seq

    def one_at_a_time(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab]: the logits after each of tokens, decoded one per step."""
        seq = self.prefilled(prompt)
        rows = []
        for token in tokens:
            seq.token_ids.append(token)
            self.alloc.grow(seq, seq.num_tokens)
            rows.append(self.executor.execute(all_rows_inputs(ScheduledBatch([seq], [1]))))
            seq.num_computed_tokens += 1
        return torch.cat(rows)

    def step(self, seqs: list[Sequence], counts: list[int]) -> torch.Tensor:
        """Every row's logits for one step; advances each sequence past its scheduled tokens (not its drafts)."""
        for seq, count in zip(seqs, counts):
            self.alloc.grow(seq, seq.num_computed_tokens + count + len(seq.spec_token_ids))
        logits = self.executor.execute(all_rows_inputs(ScheduledBatch(seqs, counts)))
        for seq, count in zip(seqs, counts):
            seq.num_computed_tokens += count
        return logits


def assert_same(got: torch.Tensor, want: torch.Tensor, invariant: bool) -> None:
    if invariant:
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, **TOLERANCE)


def test_verify_rows_enter_the_step_as_decodes_over_one_block_table():
    seq = Sequence(0, "r", list(range(7)), 6, GREEDY, num_computed_tokens=6, block_table=[9, 4, 7, 2])
    seq.spec_token_ids = [20, 21, 22, 23]
    other = Sequence(1, "o", list(range(5)), 5, GREEDY, num_computed_tokens=2, block_table=[5, 6])
    batch = ScheduledBatch([other, seq], [3, 1])
    inputs, sampling = build_step_inputs(batch, BLOCK_SIZE)
    assert inputs.query_start_loc.tolist() == [0, 3, 4, 5, 6, 7, 8]  # the chunk, then one row per group
    assert inputs.seq_lens.tolist() == [5, 7, 8, 9, 10, 11]  # each row's own position + 1
    assert inputs.block_tables.tolist() == [[5, 6, 0, 0]] + [[9, 4, 7, 2]] * 5
    assert inputs.positions.tolist() == [2, 3, 4, 6, 7, 8, 9, 10]
    # positions 6..10 of blocks [9, 4, 7]: offset 2, 3 of block 4, then 0..2 of block 7
    assert inputs.slot_mapping.tolist()[3:] == [4 * 4 + 2, 4 * 4 + 3, 7 * 4, 7 * 4 + 1, 7 * 4 + 2]
    assert sampling == [0, 1] and inputs.logits_indices.tolist() == [2, 7]  # the sampling row: the last draft's
    assert query_groups(batch) == [0, 1]
    assert query_groups(ScheduledBatch([seq, other], [1, 3])) == [0, 5]


def test_a_verify_step_is_a_pure_decode_step_to_the_backend(executor):
    driver = Driver(executor)
    seq = driver.prefilled(random_prompts(VOCAB, [6], seed=1)[0])
    seq.token_ids.append(3)
    seq.spec_token_ids = [4, 5, 6, 7]
    driver.alloc.grow(seq, seq.num_tokens + 4)
    inputs, _ = build_step_inputs(ScheduledBatch([seq], [1]), BLOCK_SIZE)
    model = executor._shard.model
    plan = model.backend.plan_step(inputs, model.freqs_cis, executor._shard.kv_caches[0], model.decode_step)
    meta = plan.attention
    assert inputs.num_tokens == inputs.num_seqs == 5 and meta.prefills == []  # no prefill-chunk attention
    assert meta.path in (AttentionPath.PAGED_DECODES, AttentionPath.PAGED)
    batched = meta.batched
    assert isinstance(batched, (PagedDecodes, PagedSequences))
    assert batched.seq_lens.tolist() == [7, 8, 9, 10, 11]
    assert batched.block_tables.tolist() == [seq.block_table] * 5
    # the compiled step serves it wherever it serves 5 decodes (AMX bfloat16 here; more CPUs on other branches)
    step = model.decode_step
    assert plan.compiled == (step is not None and step.max_rows >= 5)


# (prompt length, k): drafts across a block boundary; more drafts than the block has room for
# (the last token in a block's last slot, 6 drafts over the next two blocks); a single draft
@pytest.mark.parametrize(("prompt_len", "k"), [(6, 4), (7, 6), (5, 1), (9, 3)])
def test_verify_rows_equal_the_tokens_decoded_one_at_a_time(executor, prompt_len, k):
    driver = Driver(executor, seed=prompt_len)
    prompt, tokens = random_prompts(VOCAB, [prompt_len, k + 1], seed=prompt_len + k)
    want = driver.one_at_a_time(prompt, tokens)
    seq = driver.prefilled(prompt)
    seq.token_ids.append(tokens[0])
    seq.spec_token_ids = tokens[1:]
    got = driver.step([seq], [1])
    assert got.shape == want.shape == (k + 1, VOCAB)
    assert_same(got, want, executor.invariant)


def test_a_rejected_drafts_kv_is_not_seen_next_step(executor):
    """Drafts 2..4 rejected: their K/V stays in the cache past the sequence's end. The next verify
    step (the correction and one new draft) overwrites two of those slots and must not see the
    third: it gives the logits of the accepted tokens alone."""
    driver = Driver(executor, seed=3)
    prompt, tokens, junk = random_prompts(VOCAB, [6, 4, 3], seed=9)
    seq = driver.prefilled(prompt)
    seq.token_ids.append(tokens[0])  # position 6
    seq.spec_token_ids = [tokens[1], *junk]  # positions 7..10: draft 1 accepted, drafts 2..4 rejected
    driver.step([seq], [1])
    seq.token_ids += [tokens[1], tokens[2]]  # the accepted draft, then the correction (position 8)
    seq.num_computed_tokens += 1  # the accepted draft's K/V stays
    seq.spec_token_ids = [tokens[3]]  # position 9; junk[2]'s K/V at position 10 is left behind
    got = driver.step([seq], [1])
    assert got.shape[0] == 2
    assert_same(got, driver.one_at_a_time(prompt, tokens)[2:], executor.invariant)


def test_verify_rows_in_a_mixed_step(executor):
    """A prefill chunk, a plain decode and two speculating sequences in one step: each speculating
    sequence's rows give its one-at-a-time logits, the others their own."""
    driver = Driver(executor, seed=4)
    prompts = random_prompts(VOCAB, [7, 5, 9, 10], seed=11)
    drafts = random_prompts(VOCAB, [4, 1, 3], seed=12)  # [t0, drafts...] of seq 0 and 2; seq 1's decode
    want_spec = [driver.one_at_a_time(prompts[0], drafts[0]), driver.one_at_a_time(prompts[2], drafts[2])]
    want_decode = driver.one_at_a_time(prompts[1], drafts[1])
    want_chunk = driver.one_at_a_time(prompts[3][:4], prompts[3][4:8])  # the chunk's last 4 rows, decoded
    seqs = [driver.prefilled(prompts[i]) for i in range(3)]
    for seq, tokens in zip(seqs, drafts):
        seq.token_ids.append(tokens[0])
        seq.spec_token_ids = tokens[1:]
    chunk = driver.prefilled(prompts[3][:4])
    chunk.token_ids = list(prompts[3])
    chunk.num_prompt_tokens = len(prompts[3])
    got = driver.step([seqs[0], chunk, seqs[1], seqs[2]], [1, 5, 1, 1])
    rows = torch.split(got, [4, 5, 1, 3])
    assert_same(rows[0], want_spec[0], executor.invariant)
    assert_same(rows[2], want_decode, executor.invariant)
    assert_same(rows[3], want_spec[1], executor.invariant)
    # the prefill chunk runs prefill attention, the decodes the decode kernels: close, not equal
    torch.testing.assert_close(rows[1][:4], want_chunk, **TOLERANCE)
