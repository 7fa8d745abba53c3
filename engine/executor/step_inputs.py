"""The flat tensors one forward step needs: the only thing rank 0 broadcasts to its followers.

Layout: the batch is one flat run of `num_tokens` new tokens from `num_seqs` sequences, sequence
i owning rows query_start_loc[i]:query_start_loc[i+1]. Prefill chunks and single decode tokens
mix freely. Every new token's K/V is written to its slot in the paged cache before attention
reads the sequence's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset for each new K/V
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, K/V length of each sequence after this step
    logits_indices: torch.Tensor  # [num_logits] int64, rows of the flat batch whose logits are wanted
    # [num_seqs] int64, each sequence's engine LoRA id (0: the base alone; engine/lora/layers.py);
    # None when no sequence of the step has an adapter (the usual step pays nothing for LoRA)
    lora_ids: torch.Tensor | None = None
    # Early fusion (Llama 4 images): these rows' embeddings are replaced by image_embeds' rows.
    # None on a step without image tokens; built on rank 0 by engine/executor/images.py.
    image_rows: torch.Tensor | None = None  # [num_image_rows] int64
    image_embeds: torch.Tensor | None = None  # [num_image_rows, dim] in the model dtype

    def to(self, device: torch.device) -> "StepInputs":
        """On `device`; self when every tensor is there already (a CPU model's every step)."""
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        if all(t is None or t.device == device for t in tensors.values()):
            return self
        return StepInputs(**{name: None if t is None else t.to(device, non_blocking=True) for name, t in tensors.items()})

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
