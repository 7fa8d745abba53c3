"""The flat tensors one forward step needs: the only thing rank 0 broadcasts to its followers.

Layout: the batch is one flat run of `num_tokens` new tokens in `num_seqs` query groups, group i
owning rows query_start_loc[i]:query_start_loc[i+1], its K/V length after the step seq_lens[i],
read through block_tables[i]. A group is a sequence's chunk (a prefill chunk or a single decode
token); a speculating sequence's draft rows are one group each after its own, over the same block
table with lengths one longer each (engine/executor/executor.py build_step_inputs), so verify rows
are decodes to every backend. Prefill chunks and decode tokens mix freely. Every new token's K/V
is written to its slot in the paged cache before attention reads any group's blocks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.core.sequence import ScheduledBatch


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset for each new K/V
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0 (a group's sequence's table)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts of the groups
    seq_lens: torch.Tensor  # [num_seqs] int32, K/V length of each group after this step (its last row's position + 1)
    logits_indices: torch.Tensor  # [num_logits] int64, rows of the flat batch whose logits are wanted
    # [num_seqs] int64, each group's sequence's engine LoRA id (0: the base alone; engine/lora/layers.py);
    # None when no sequence of the step has an adapter (the usual step pays nothing for LoRA)
    lora_ids: torch.Tensor | None = None
    # Early fusion (Llama 4 images): these rows' embeddings are replaced by image_embeds' rows.
    # None on a step without image tokens; built on rank 0 by engine/executor/images.py.
    image_rows: torch.Tensor | None = None  # [num_image_rows] int64
    image_embeds: torch.Tensor | None = None  # [num_image_rows, dim] in the model dtype
    # logits_indices itself (the same object) when it is every row in order, 0..num_tokens - 1 (a step
    # whose every row samples, such as a pure-decode step): the forward then feeds the head its rows
    # as they are instead of an index_select copy (a torch op run cold after the blocks: ~60 us of a
    # one-stream step, bench/NOTES.md 'The engine thread's Python per decode step'). Held by identity,
    # so a step whose logits_indices is replaced (more rows, another order) gathers again by itself.
    every_row_indices: torch.Tensor | None = None
    # The index ranges of a pure-decode step as build_step_inputs made it (None otherwise, and on
    # followers): the CPU backend checks them and lays the step out without a torch call (DecodeBounds).
    decode_bounds: "DecodeBounds | None" = None

    def to(self, device: torch.device) -> "StepInputs":
        """On `device`; self when every tensor is there already (a CPU model's every step)."""
        tensors = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("every_row_indices", "decode_bounds")}
        if all(t is None or t.device == device for t in tensors.values()):
            return self
        moved = {name: None if t is None else t.to(device, non_blocking=True) for name, t in tensors.items()}
        every_row = moved["logits_indices"] if self.takes_every_row else None
        return StepInputs(**moved, every_row_indices=every_row)

    @property
    def takes_every_row(self) -> bool:
        """Whether logits_indices is every row in order (see every_row_indices)."""
        return self.every_row_indices is self.logits_indices

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass(frozen=True, slots=True)
class DecodeBounds:
    """The inclusive (low, high) ranges of a pure-decode step's index tensors (every group one row,
    every row sampling, no LoRA), taken from the Python lists build_step_inputs made them from: the CPU
    backend's bounds checks read these instead of reducing the tensors (~20 torch calls, run cold
    right after the forward streamed the weights: bench/NOTES.md 'A pure-decode step's layout without
    torch'). Holds the tensors it describes and answers for them alone (`describes`, by identity), so a
    StepInputs whose fields were replaced falls back to the checks on the tensors by itself (nothing
    writes a step's index tensors in place after build_step_inputs: a writer must drop the bounds)."""

    positions: tuple[int, int]
    slots: tuple[int, int]
    block_ids: tuple[int, int]
    seq_lens: tuple[int, int]
    tensors: tuple[torch.Tensor, ...]  # (positions, slot_mapping, block_tables, seq_lens, query_start_loc, logits_indices)

    def describes(self, inputs: StepInputs) -> bool:
        """Whether these bounds are of `inputs`' own tensors, and it is still a pure-decode step
        whose every row samples in order with nothing else in it."""
        own = (inputs.positions, inputs.slot_mapping, inputs.block_tables, inputs.seq_lens, inputs.query_start_loc, inputs.logits_indices)
        return (all(a is b for a, b in zip(own, self.tensors, strict=True)) and inputs.takes_every_row and inputs.lora_ids is None
                and inputs.image_rows is None)  # fmt: skip


def query_groups(batch: "ScheduledBatch") -> list[int]:
    """The query group (StepInputs' index i) of each batch sequence's first row: a speculating
    sequence has 1 + k groups, its own chunk and one per draft row; any other sequence one."""
    return list(itertools.accumulate((1 + len(seq.spec_token_ids) for seq in batch.seqs[:-1]), initial=0))
