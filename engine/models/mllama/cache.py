"""One rank's per-sequence cross-attention states (Llama 3.2 Vision), apart from the paged text KV.

Filled and emptied only by CrossAttentionUpdate messages from rank 0 (engine/executor/cross_attention.py),
so every rank holds the same sequences. Each state is the keys/values of one sequence's images for
every cross-attention layer (engine/models/mllama/model.py CrossAttentionState)."""

from __future__ import annotations

import torch

from engine.models.args import ModelArgs
from engine.models.mllama.model import CrossAttentionState, MllamaTransformer


def state_bytes_per_image(args: ModelArgs, mp_size: int, tokens_per_tile: int, dtype: torch.dtype) -> int:
    """This rank's bytes for one image at the most tiles: K and V of every cross-attention layer."""
    keys = args.vision_max_num_chunks * tokens_per_tile
    per_layer = 2 * max(1, args.kv_heads // mp_size) * keys * args.head_dim
    return args.vision_num_cross_attention_layers * per_layer * torch.empty((), dtype=dtype).element_size()


class CrossAttentionCache:
    def __init__(self, model: MllamaTransformer) -> None:
        self.model = model
        self.states: dict[int, CrossAttentionState] = {}
        self.step_seq_ids: list[int] = []  # the next step's sequences (-1: no image)

    @property
    def num_states(self) -> int:
        return len(self.states)

    @property
    def bytes_in_use(self) -> int:
        return sum(state.nbytes for state in self.states.values())

    def apply(self, free_seq_ids: torch.Tensor, image_meta: torch.Tensor, pixels: torch.Tensor, step_seq_ids: torch.Tensor) -> None:
        for seq_id in free_seq_ids.tolist():
            self.states.pop(seq_id, None)
        meta = image_meta.tolist()
        i = 0
        while i < len(meta):  # one sequence's images are consecutive
            seq_id = meta[i][0]
            j = i
            while j < len(meta) and meta[j][0] == seq_id:
                j += 1
            rows = meta[i:j]
            self.states[seq_id] = self.model.cross_attention_state(
                pixels[i:j], [(r[1], r[2]) for r in rows], [(r[3], r[4]) for r in rows]
            )
            i = j
        self.step_seq_ids = step_seq_ids.tolist()

    def for_step(self) -> list[CrossAttentionState | None] | None:
        """The states of the next step's sequences, in batch order; None when none has an image."""
        ids, self.step_seq_ids = self.step_seq_ids, []
        if not ids:
            return None
        return [self.states[seq_id] if seq_id >= 0 else None for seq_id in ids]  # a missing state is rank 0's bug: fail the step
