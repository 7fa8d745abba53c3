"""The executor: ScheduledBatch -> StepInputs -> forward on every rank -> sample -> StepOutput, on rank 0.

It owns no model: it flattens the scheduler's batch into the int tensors the worker group
broadcasts and runs, then samples the rows it asked logits for. Per step it touches Python once
per sequence and once per KV block a chunk spans; per-token quantities (ids, positions, slots)
are list slices and ranges extended in C, so a 512-token prefill chunk costs little more Python
than a single decode.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.core.sampler import Sampler, is_greedy
from engine.core.sequence import ScheduledBatch, StepOutput
from engine.executor.cross_attention import CrossAttentionTracker
from engine.executor.images import ImageRows
from engine.executor.step_inputs import DecodeBounds, StepInputs
from engine.executor.worker_group import Workers
from engine.spec.verify import Verifier, greedy_verdict
from engine.types import TokenLogprob

PromptSpan = tuple[int, int, int]  # (batch index, first flat row, number of rows) of prompt-scoring rows


def build_step_inputs(batch: ScheduledBatch, block_size: int) -> tuple[StepInputs, list[int]]:
    """The flat CPU tensors for one step, and the batch positions of the sequences that sample.

    A speculating sequence (a decode with draft tokens, engine/spec/) enters as 1 + k query groups of
    one row each, all over its block table, with K/V lengths ctx + 1 .. ctx + 1 + k: exactly 1 + k
    decodes (every row's K/V is written before any row attends, and each row attends the keys up to
    its own position), so to the backend a verify step is a pure-decode step of 1 + k rows and takes
    the decode attention kernels and the compiled decode step, not a prefill chunk's path. The flat
    rows are the same either way: a sequence's rows stay consecutive (its draft rows follow its own).

    Raises ValueError when the batch is inconsistent (a chunk past the sequence's end, or a block
    table too short for it): writing K/V into a padding block would silently corrupt another
    sequence, so that is a scheduler bug to surface, not to run.

    Built as Python int lists (positions and slots as ranges, one per block a chunk spans: per
    token only C-level list extends) and turned into two tensors, one per dtype, whose slices are
    the fields: a handful of torch calls per step instead of ~20 small tensor ops. Those ran right
    after the forward streamed the weights through every cache and cost 0.3-0.5 ms at one stream."""
    seqs, counts = batch.seqs, batch.num_new_tokens
    max_blocks = max(len(seq.block_table) for seq in seqs)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    block_rows: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    lora_ids: list[int] = []
    sampling: list[int] = []
    logits_rows: list[int] = []
    for i, (seq, count) in enumerate(zip(seqs, counts)):
        start, table = seq.num_computed_tokens, seq.block_table
        end = start + count
        num_spec = len(seq.spec_token_ids)
        spec_end = end + num_spec
        if count <= 0 or end > seq.num_tokens or len(table) * block_size < spec_end:
            raise ValueError(
                f"sequence {seq.seq_id}: cannot compute tokens [{start}, {spec_end}) of {seq.num_tokens} "
                f"with {len(table)} blocks of {block_size}"
            )
        input_ids += seq.token_ids[start:end]
        if num_spec:
            input_ids += seq.spec_token_ids
        positions += range(start, spec_end)
        for block in range(start // block_size, (spec_end - 1) // block_size + 1):  # slot = table[block] * bs + offset
            first, last = max(start, block * block_size), min(spec_end, (block + 1) * block_size)
            shift = (table[block] - block) * block_size
            slots += range(first + shift, last + shift)
        # query groups: the chunk (one decode row for a speculating sequence), then one per draft row
        groups = 1 + num_spec
        padded = table + [0] * (max_blocks - len(table)) if len(table) < max_blocks else table
        block_rows += padded * groups
        row = query_start_loc[-1] + count
        query_start_loc.append(row)
        seq_lens.append(end)
        if num_spec:
            query_start_loc += range(row + 1, row + num_spec + 1)
            seq_lens += range(end + 1, spec_end + 1)
        lora_ids += [seq.lora_id] * groups
        if end == seq.num_tokens:
            sampling.append(i)
            logits_rows.append(query_start_loc[-1] - 1)

    num_seqs, num_tokens = len(seq_lens), len(input_ids)
    wide = torch.tensor(input_ids + positions + slots + logits_rows, dtype=torch.int64)
    narrow = torch.tensor(block_rows + query_start_loc + seq_lens, dtype=torch.int32)
    num_table = num_seqs * max_blocks
    inputs = StepInputs(
        input_ids=wide[:num_tokens],
        positions=wide[num_tokens : 2 * num_tokens],
        slot_mapping=wide[2 * num_tokens : 3 * num_tokens],
        block_tables=narrow[:num_table].view(num_seqs, max_blocks),
        query_start_loc=narrow[num_table : num_table + num_seqs + 1],
        seq_lens=narrow[num_table + num_seqs + 1 :],
        logits_indices=wide[3 * num_tokens :],
        lora_ids=torch.tensor(lora_ids, dtype=torch.int64) if any(lora_ids) else None,
    )
    if len(logits_rows) == num_tokens:  # they ascend: every row, in order
        inputs.every_row_indices = inputs.logits_indices
        if num_tokens == num_seqs and inputs.lora_ids is None:  # a pure-decode step: its ranges from the lists
            inputs.decode_bounds = DecodeBounds(
                (min(positions), max(positions)), (min(slots), max(slots)), (min(block_rows), max(block_rows)),
                (min(seq_lens), max(seq_lens)),
                (inputs.positions, inputs.slot_mapping, inputs.block_tables, inputs.seq_lens, inputs.query_start_loc, inputs.logits_indices),
            )  # fmt: skip
    return inputs, sampling


def grouped_by_adapter(batch: ScheduledBatch) -> ScheduledBatch:
    """The batch with sequences of one adapter next to each other (decodes before prefill chunks,
    the base first, else the scheduler's order), so each adapter's rows are one run of consecutive
    rows (engine/lora/layers.py): one pair of small matmuls per adapter and linear, not per
    sequence. The batch unchanged when no sequence has an adapter."""
    if not any(seq.lora_id for seq in batch.seqs):
        return batch
    order = sorted(range(len(batch.seqs)), key=lambda i: (batch.num_new_tokens[i] > 1, batch.seqs[i].lora_id))
    return ScheduledBatch([batch.seqs[i] for i in order], [batch.num_new_tokens[i] for i in order])


def speculation_rows(batch: ScheduledBatch) -> list[PromptSpan]:
    """(batch index, first flat row, k) of each speculating sequence: the rows of its last committed
    token and its first k - 1 drafts, whose logits verify drafts 1..k; the row of draft k is its
    sampling row already (the bonus token when every draft is accepted)."""
    spans: list[PromptSpan] = []
    first_row = 0
    for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        num_spec = len(seq.spec_token_ids)
        if num_spec:
            spans.append((i, first_row + count - 1, num_spec))
        first_row += count + num_spec
    return spans


def prompt_logprob_spans(batch: ScheduledBatch) -> list[PromptSpan]:
    """The rows whose logits score a prompt token, for the sequences that want prompt logprobs.

    The row at position p scores token p + 1, so a chunk [c, c + n) scores prompt tokens
    [c + 1, min(c + n + 1, num_prompt_tokens)); the row of the last prompt token is the sampling
    row, which build_step_inputs asks for already."""
    spans: list[PromptSpan] = []
    # a speculating sequence's draft rows follow its own (build_step_inputs)
    row_starts = itertools.accumulate((n + len(s.spec_token_ids) for s, n in zip(batch.seqs, batch.num_new_tokens)), initial=0)
    for i, (seq, count, first_row) in enumerate(zip(batch.seqs, batch.num_new_tokens, row_starts)):
        if seq.wants_prompt_logprobs:
            start = seq.num_computed_tokens
            num_rows = min(start + count, seq.num_prompt_tokens - 1) - start
            if num_rows > 0:
                spans.append((i, first_row, num_rows))
    return spans


def prompt_logprobs(logits: torch.Tensor, batch: ScheduledBatch, spans: list[PromptSpan]) -> dict[int, list[TokenLogprob]]:
    """seq_id -> TokenLogprob per scored prompt token, from the spans' logits rows (in span order):
    raw-model log-softmax in at least float32, plus the params.prompt_logprobs best alternatives."""
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=1)
    targets: list[int] = []
    for i, _, num_rows in spans:
        seq = batch.seqs[i]
        start = seq.num_computed_tokens + 1
        targets += seq.token_ids[start : start + num_rows]
    target_t = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
    chosen = logprobs.gather(1, target_t.unsqueeze(1)).squeeze(1).tolist()
    ks = [min(batch.seqs[i].params.prompt_logprobs or 0, logprobs.shape[1]) for i, _, _ in spans]
    top_values: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if max(ks) > 0:
        values, ids = torch.topk(logprobs, max(ks), dim=1)
        top_values, top_ids = values.tolist(), ids.tolist()
    out: dict[int, list[TokenLogprob]] = {}
    row = 0
    for (i, _, num_rows), k in zip(spans, ks):
        out[batch.seqs[i].seq_id] = [
            TokenLogprob(targets[r], chosen[r], list(zip(top_ids[r][:k], top_values[r][:k])))
            for r in range(row, row + num_rows)
        ]
        row += num_rows
    return out


class Executor(Protocol):
    """What EngineCore drives: a ScheduledBatch in, sampled tokens out. ModelExecutor below is the real
    one (inputs -> worker group -> sampler); the engine tests use fakes."""

    num_blocks: int  # KV cache blocks available to the block pool
    block_size: int  # tokens per block
    vocab_size: int

    def execute(self, batch: ScheduledBatch) -> StepOutput: ...

    def shutdown(self) -> None: ...


class ModelExecutor:
    """Executor over a worker group (engine/executor/worker_group.py) and the sampler."""

    def __init__(self, workers: Workers, *, seed: int = 0, image_rows: ImageRows | None = None) -> None:
        self._workers = workers
        self._image_rows = image_rows  # early fusion (a model that takes images); None: text only
        self.vocab_size: int = workers.vocab_size
        self.num_blocks: int = workers.num_blocks
        self.block_size: int = workers.block_size
        self._sampler = Sampler(seed=seed, kernels=workers.argmax_kernels)
        # Llama 3.2 Vision's cross-attention states on the workers (None: a text model, or a fake)
        cross = getattr(workers, "cross_attention", None)
        self._cross: CrossAttentionTracker | None = None
        if cross is not None:
            args = cross.model.params
            self._cross = CrossAttentionTracker(vocab_size=args.vocab_size, max_tiles=args.vision_max_num_chunks,
                                                chunk_size=args.vision_chunk_size)  # fmt: skip
        self._verifier = Verifier(seed=seed)  # speculative decoding's draft tokens (engine/spec/verify.py)

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step. Worker exceptions propagate (the core fails the batch's requests); a
        sampling error confined to one sequence lands in StepOutput.errors and that sequence is
        left out of seq_ids/sampled_token_ids/logprobs."""
        if not batch.seqs:
            return StepOutput(seq_ids=[], sampled_token_ids=[], logprobs=[])
        batch = grouped_by_adapter(batch)  # StepOutput is keyed by seq_id: the order is the executor's own
        inputs, sampling = build_step_inputs(batch, self.block_size)
        if self._cross is not None and (update := self._cross.plan(batch, inputs)) is not None:
            self._workers.update_cross_attention(update)  # type: ignore[attr-defined]
        if self._image_rows is not None:
            fused = self._image_rows.step(batch)
            if fused is not None:
                inputs.image_rows, inputs.image_embeds = fused
        # Prompt-logprob rows go after the sampling rows; without them this step is untouched.
        spans = prompt_logprob_spans(batch) if any(seq.wants_prompt_logprobs for seq in batch.seqs) else []
        spec = speculation_rows(batch) if any(seq.spec_token_ids for seq in batch.seqs) else []
        if spans or spec:
            extra = [torch.arange(first, first + num, dtype=torch.int64) for _, first, num in (*spans, *spec)]
            inputs.logits_indices = torch.cat([inputs.logits_indices, *extra])
        logits = self._workers.execute(inputs)  # partial chunks still run: they fill the cache
        seqs = [batch.seqs[i] for i in sampling]
        result = self._sampler.sample(logits[: len(sampling)] if spans or spec else logits, seqs)
        out = StepOutput(seq_ids=[], sampled_token_ids=[], logprobs=[], errors=result.errors)
        num_prompt_rows = sum(num for _, _, num in spans)
        if spans:
            out.prompt_logprobs = prompt_logprobs(logits[len(sampling) : len(sampling) + num_prompt_rows], batch, spans)
        corrections = self._verify(logits[len(sampling) + num_prompt_rows :], batch, spec, out) if spec else {}
        for seq, token, logprob in zip(seqs, result.token_ids, result.logprobs):
            if seq.seq_id not in result.errors:
                out.seq_ids.append(seq.seq_id)
                out.sampled_token_ids.append(corrections.get(seq.seq_id, token))
                out.logprobs.append(logprob)
        return out

    def _verify(self, logits: torch.Tensor, batch: ScheduledBatch, spec: list[PromptSpan], out: StepOutput) -> dict[int, int]:
        """Verify each speculating sequence's drafts over its rows of logits (in span order): its accepted
        drafts go to out.accepted_token_ids; seq_id -> the correction token where a draft was rejected
        (it replaces the sampled bonus token)."""
        corrections: dict[int, int] = {}
        # greedy rows (the usual case) need only each row's argmax: one call for every row of the step
        targets = logits.argmax(dim=1).tolist() if any(is_greedy(batch.seqs[i].params) for i, _, _ in spec) else []
        row = 0
        for i, _, num_spec in spec:
            seq = batch.seqs[i]
            if is_greedy(seq.params):
                verdict = greedy_verdict(targets[row : row + num_spec], seq.spec_token_ids)
            else:
                verdict = self._verifier.verify(logits[row : row + num_spec], seq.spec_token_ids, seq.params,
                                                seq.num_output_tokens)
            row += num_spec
            out.accepted_token_ids[seq.seq_id] = seq.spec_token_ids[: verdict.num_accepted]
            if verdict.correction is not None:
                corrections[seq.seq_id] = verdict.correction
        return corrections

    def read_adapter(self, folder: Path, roots: tuple[Path, ...] = ()) -> Any:
        """An adapter folder read and checked against this model (engine.lora.adapters.read_adapter)."""
        from engine.lora.adapters import read_adapter

        return read_adapter(folder, self._workers.model_args, max_rank=self._workers.max_lora_rank, roots=roots)

    def load_adapter(self, lora_id: int, adapter: Any, path: str) -> int:
        """Install an adapter on every rank (between steps: the engine thread calls it); bytes held."""
        return self._workers.load_adapter(lora_id, adapter, path)

    def unload_adapter(self, lora_id: int) -> None:
        self._workers.unload_adapter(lora_id)

    def release_finished(self) -> None:
        """Drop the cross-attention states of finished, aborted and preempted sequences now."""
        if self._cross is not None and self._cross.sweep():
            self._workers.update_cross_attention(self._cross.take_frees())  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        self._workers.shutdown()
