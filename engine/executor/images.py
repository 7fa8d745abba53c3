"""Early fusion's step inputs: which rows of a step's flat batch are image tokens, and their
embeddings (Llama 4: the projected vision-encoder patches, engine/models/llama4/vision.py).

An image is encoded once per sequence, when the first chunk that reaches its tokens is scheduled,
and kept until its last token is computed, so a chunked prefill that splits an image's tokens
slices the same rows. The rows are its span's image tokens (`image_token_id`: <|patch|>) in order,
as the reference's scatter_embeddings fills them. An entry whose sequence is not in a step (it
finished, was aborted or preempted) is dropped: a preempted sequence encodes again on its recompute.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.core.sequence import ScheduledBatch

ImageEncoder = Callable[[torch.Tensor], torch.Tensor]  # pixels [chunks, 3, H, W] -> rows [image tokens, dim]


class ImageRows:
    def __init__(self, encoder: ImageEncoder, image_token_id: int) -> None:
        self._encode = encoder
        self._image_token_id = image_token_id
        # (seq_id, image index) -> (prompt positions of its image tokens, their embeddings)
        self._encoded: dict[tuple[int, int], tuple[list[int], torch.Tensor]] = {}

    def step(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat rows, embeddings) of this step's image tokens, or None when it has none."""
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        first_row = 0
        live: set[tuple[int, int]] = set()
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + count
            for k, placement in enumerate(seq.images):
                span_end = placement.offset + placement.length
                if placement.offset >= end or span_end <= start:
                    if span_end > end:  # still ahead: keep it for a later chunk
                        live.add((seq.seq_id, k))
                    continue
                positions, embeds = self._encoded_image(seq.seq_id, k, seq.token_ids, placement)
                picked = [i for i, pos in enumerate(positions) if start <= pos < end]
                rows += [first_row + positions[i] - start for i in picked]
                parts.append(embeds[picked[0]: picked[-1] + 1] if picked else embeds[:0])
                if span_end > end:
                    live.add((seq.seq_id, k))
            first_row += count
        self._encoded = {key: value for key, value in self._encoded.items() if key in live}
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.int64), torch.cat(parts)

    def _encoded_image(self, seq_id: int, k: int, token_ids: list[int], placement) -> tuple[list[int], torch.Tensor]:
        key = (seq_id, k)
        if key not in self._encoded:
            span = token_ids[placement.offset: placement.offset + placement.length]
            positions = [placement.offset + i for i, t in enumerate(span) if t == self._image_token_id]
            embeds = self._encode(placement.image.pixels)
            if embeds.shape[0] != len(positions):
                raise ValueError(f"image {placement.image.param}: {embeds.shape[0]} embeddings for "
                                 f"{len(positions)} image tokens")
            self._encoded[key] = positions, embeds
        return self._encoded[key]
