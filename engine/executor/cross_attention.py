"""Llama 3.2 Vision's per-sequence cross-attention state, seen from rank 0: which sequences have
their image states on the workers, which images a step must encode first, and which states to drop.

A sequence's cross-attention keys/values are computed once, on the first step that schedules it
after admission (or after a preemption, which drops them with its KV blocks: a resumed sequence
recomputes both), kept on every rank apart from the paged text KV (engine/executor/worker.py), and
dropped once the sequence is finished, aborted or preempted (CrossAttentionTracker.sweep, run
before each step and after each step's update). Rank 0 sends followers a CrossAttentionUpdate,
flat tensors like StepInputs, ahead of the step that needs it (engine/executor/parallel.py).

The <|image|> marker of a placement is fed to the model as id vocab_size (llama-models'
LLMInput turns <|image|> into 128256, the first learnable image-token row) and the text spans
attending each image follow llama-models' create_vision_mask over the markers' positions
(engine/vision/mllama.py vision_spans).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.sequence import ScheduledBatch, Sequence, SequenceStatus
from engine.executor.step_inputs import StepInputs, query_groups
from engine.vision.mllama import stack_tiles, vision_spans

NO_SEQ = -1


@dataclass(slots=True)
class CrossAttentionUpdate:
    """What the workers apply before a step: drop states, encode new images, and which state
    each sequence of the next step reads."""

    free_seq_ids: torch.Tensor  # [num_free] int64
    image_meta: torch.Tensor  # [num_images, 5] int64: seq_id, tile rows, tile columns, span start, span end (-1: none)
    pixels: torch.Tensor  # [num_images, max_tiles, 3, chunk, chunk] float32, real tiles first, zeros after
    step_seq_ids: torch.Tensor  # [num_seqs] int64: the next step's query groups' sequence ids, NO_SEQ where it has no image

    @property
    def num_images(self) -> int:
        return int(self.image_meta.shape[0])


class CrossAttentionTracker:
    """Rank 0's record of the sequences whose cross-attention state the workers hold."""

    def __init__(self, *, vocab_size: int, max_tiles: int, chunk_size: int) -> None:
        self.vocab_size = vocab_size
        self.max_tiles, self.chunk_size = max_tiles, chunk_size
        self._live: dict[int, Sequence] = {}
        self._pending_free: list[int] = []

    @property
    def num_live(self) -> int:
        return len(self._live)

    def sweep(self) -> bool:
        """Mark the states of finished, aborted and preempted sequences to drop; True if any."""
        for seq_id, seq in list(self._live.items()):
            if seq.status in (SequenceStatus.FINISHED, SequenceStatus.PREEMPTED):
                del self._live[seq_id]
                self._pending_free.append(seq_id)
        return bool(self._pending_free)

    def take_frees(self) -> CrossAttentionUpdate:
        """A frees-only update (nothing to encode, no step follows)."""
        return self._update([], [])

    def plan(self, batch: ScheduledBatch, inputs: StepInputs) -> CrossAttentionUpdate | None:
        """This step's update (None: no image in the batch and nothing to drop); the markers of
        the batch's images in inputs.input_ids become vocab_size (in place: inputs is this step's own)."""
        self.sweep()
        if not any(seq.images for seq in batch.seqs):
            return self._update([], []) if self._pending_free else None
        new: list[tuple[Sequence, list[tuple[int, int]]]] = []
        step_ids: list[int] = []
        starts = inputs.query_start_loc.tolist()
        groups = query_groups(batch)  # a speculating sequence's draft rows are query groups of their own
        for i, seq in enumerate(batch.seqs):
            # one id per query group: each of a speculating sequence's rows reads its state
            step_ids += [seq.seq_id if seq.images else NO_SEQ] * (1 + len(seq.spec_token_ids))
            if not seq.images:
                continue
            if seq.seq_id not in self._live:
                locations = [p.offset for p in seq.images]
                new.append((seq, vision_spans(locations, seq.num_prompt_tokens)))
                self._live[seq.seq_id] = seq
            first = seq.num_computed_tokens
            for placement in seq.images:  # markers inside this step's chunk
                for pos in range(max(placement.offset, first), min(placement.offset + placement.length, first + batch.num_new_tokens[i])):
                    inputs.input_ids[starts[groups[i]] + pos - first] = self.vocab_size
        return self._update(new, step_ids)

    def _update(self, new: list[tuple[Sequence, list[tuple[int, int]]]], step_ids: list[int]) -> CrossAttentionUpdate:
        meta: list[list[int]] = []
        tiles: list[torch.Tensor] = []
        for seq, spans in new:
            for placement, (start, end) in zip(seq.images, spans):
                rows, columns = placement.image.aspect_ratio
                meta.append([seq.seq_id, rows, columns, start, end])
                tiles.append(placement.image.pixels)  # type: ignore[arg-type]
        pixels = stack_tiles(tiles, self.max_tiles, self.chunk_size)
        frees, self._pending_free = self._pending_free, []
        return CrossAttentionUpdate(
            free_seq_ids=torch.tensor(frees, dtype=torch.int64),
            image_meta=torch.tensor(meta, dtype=torch.int64).view(-1, 5),
            pixels=pixels,
            step_seq_ids=torch.tensor(step_ids, dtype=torch.int64),
        )
