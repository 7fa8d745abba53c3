"""ScheduledBatch -> StepInputs -> forward -> sample -> StepOutput, on rank 0.

The runner owns no model: it flattens the scheduler's batch into the int tensors the executor
broadcasts and runs, then samples the rows it asked logits for. Per step it touches Python once
per sequence (list slices and counters); every per-token quantity (positions, slots) is computed
by tensor ops, so a 512-token prefill chunk costs the same Python as a single decode.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.sampler import Sampler
from engine.sequence import ScheduledBatch, StepOutput
from engine.step_inputs import StepInputs


class Executor(Protocol):
    """The model side (engine/executor.py): runs one forward step on every model-parallel rank."""

    vocab_size: int
    num_blocks: int
    block_size: int

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """[num_logits, vocab] float32: logits of the rows inputs.logits_indices names, in order."""
        ...

    def shutdown(self) -> None: ...


def build_step_inputs(batch: ScheduledBatch, block_size: int) -> tuple[StepInputs, list[int]]:
    """The flat CPU tensors for one step, and the batch positions of the sequences that sample.

    Raises ValueError when the batch is inconsistent (a chunk past the sequence's end, or a block
    table too short for it): writing K/V into a padding block would silently corrupt another
    sequence, so that is a scheduler bug to surface, not to run."""
    seqs, counts = batch.seqs, batch.num_new_tokens
    starts = [seq.num_computed_tokens for seq in seqs]
    input_ids: list[int] = []
    sampling: list[int] = []
    max_blocks = max(len(seq.block_table) for seq in seqs)
    padding = [0] * max_blocks
    block_rows: list[int] = []
    for i, (seq, start, count) in enumerate(zip(seqs, starts, counts)):
        end = start + count
        if count <= 0 or end > seq.num_tokens or len(seq.block_table) * block_size < end:
            raise ValueError(
                f"sequence {seq.seq_id}: cannot compute tokens [{start}, {end}) of {seq.num_tokens} "
                f"with {len(seq.block_table)} blocks of {block_size}"
            )
        input_ids += seq.token_ids[start:end]
        block_rows += seq.block_table
        block_rows += padding[: max_blocks - len(seq.block_table)]
        if end == seq.num_tokens:
            sampling.append(i)

    num_seqs, num_tokens = len(seqs), len(input_ids)
    start_t = torch.tensor(starts, dtype=torch.int64)
    count_t = torch.tensor(counts, dtype=torch.int64)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int64)
    query_start_loc[1:] = torch.cumsum(count_t, dim=0)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), count_t)  # [num_tokens]
    # position of flat row r in sequence s: start[s] + (r - query_start_loc[s])
    positions = torch.arange(num_tokens, dtype=torch.int64) + (start_t - query_start_loc[:-1])[seq_of_token]
    block_tables = torch.tensor(block_rows, dtype=torch.int32).view(num_seqs, max_blocks)
    block_ids = block_tables[seq_of_token, positions // block_size].to(torch.int64)
    inputs = StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=positions,
        slot_mapping=block_ids * block_size + positions % block_size,
        block_tables=block_tables,
        query_start_loc=query_start_loc.to(torch.int32),
        seq_lens=(start_t + count_t).to(torch.int32),
        logits_indices=query_start_loc[1:][torch.tensor(sampling, dtype=torch.int64)] - 1,
    )
    return inputs, sampling


class ModelRunnerImpl:
    """engine.sequence.ModelRunner over a model executor and the sampler."""

    def __init__(self, executor: Executor, *, stop_token_ids: frozenset[int], seed: int = 0) -> None:
        self._executor = executor
        self.vocab_size: int = executor.vocab_size
        self.num_blocks: int = executor.num_blocks
        self.block_size: int = executor.block_size
        self._sampler = Sampler(stop_token_ids=stop_token_ids, seed=seed)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step. Executor exceptions propagate (the core fails the batch's requests); a
        sampling error confined to one sequence lands in StepOutput.errors and that sequence is
        left out of seq_ids/sampled_token_ids/logprobs."""
        if not batch.seqs:
            return StepOutput(seq_ids=[], sampled_token_ids=[], logprobs=[])
        inputs, sampling = build_step_inputs(batch, self.block_size)
        logits = self._executor.execute(inputs)  # partial chunks still run: they fill the cache
        seqs = [batch.seqs[i] for i in sampling]
        result = self._sampler.sample(logits, seqs)
        out = StepOutput(seq_ids=[], sampled_token_ids=[], logprobs=[], errors=result.errors)
        for seq, token, logprob in zip(seqs, result.token_ids, result.logprobs):
            if seq.seq_id not in result.errors:
                out.seq_ids.append(seq.seq_id)
                out.sampled_token_ids.append(token)
                out.logprobs.append(logprob)
        return out

    def shutdown(self) -> None:
        self._executor.shutdown()
