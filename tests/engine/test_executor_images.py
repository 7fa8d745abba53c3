"""engine/executor/images.py: a step's image rows, each image encoded once per sequence, sliced the
same whether a chunked prefill splits its tokens or not; entries dropped with their sequence."""

from __future__ import annotations

import torch

from engine.core.sequence import ScheduledBatch, Sequence
from engine.executor.images import ImageRows
from engine.types import ImagePlacement, PreparedImage, SamplingParams

P = 9  # the image token id (<|patch|>)


def encoder(calls: list[int]):
    def encode(pixels: torch.Tensor) -> torch.Tensor:  # one row per image token, numbered from the pixels' seed
        calls.append(int(pixels))
        return torch.arange(4, dtype=torch.float32).unsqueeze(1) + 100 * int(pixels)
    return encode


def seq_with_image(seq_id: int, seed: int, computed: int = 0) -> Sequence:
    tokens = [1, 2, 7, P, P, 8, P, P, 3, 4]  # span [2, 8): <start> P P <sep> P P ... (4 image tokens)
    image = PreparedImage(content_hash=bytes([seed]), aspect_ratio=(1, 1), num_chunks=1, tokens_per_chunk=4,
                          pixels=torch.tensor(seed))
    seq = Sequence(seq_id, f"r{seq_id}", tokens, len(tokens), SamplingParams(), num_computed_tokens=computed)
    seq.images = (ImagePlacement(image, offset=2, length=6),)
    return seq


def test_whole_prefill_rows_follow_the_image_tokens():
    calls: list[int] = []
    rows = ImageRows(encoder(calls), P)
    text = Sequence(5, "t", [1, 2, 3], 3, SamplingParams())
    out = rows.step(ScheduledBatch([text, seq_with_image(0, 1)], [3, 10]))
    assert out is not None
    flat_rows, embeds = out
    assert flat_rows.tolist() == [3 + 3, 3 + 4, 3 + 6, 3 + 7]  # after the text sequence's 3 rows
    assert embeds[:, 0].tolist() == [100.0, 101.0, 102.0, 103.0] and calls == [1]


def test_chunks_split_an_image_and_encode_it_once():
    calls: list[int] = []
    rows = ImageRows(encoder(calls), P)
    seq = seq_with_image(0, 2)
    got = []
    for start, count in ((0, 4), (4, 3), (7, 3)):
        seq.num_computed_tokens = start
        out = rows.step(ScheduledBatch([seq], [count]))
        if out is not None:
            got += [(start + r, e) for r, e in zip(out[0].tolist(), out[1][:, 0].tolist())]
    assert got == [(3, 200.0), (4, 201.0), (6, 202.0), (7, 203.0)] and calls == [2]
    assert rows.step(ScheduledBatch([seq_with_image(1, 3, computed=8)], [2])) is None  # past the image: nothing
    assert rows._encoded == {}  # noqa: SLF001 - nothing kept for finished images


def test_a_sequence_missing_from_a_step_is_dropped_and_encoded_again():
    calls: list[int] = []
    rows = ImageRows(encoder(calls), P)
    seq = seq_with_image(0, 4)
    rows.step(ScheduledBatch([seq], [4]))  # half the image
    rows.step(ScheduledBatch([Sequence(1, "t", [1], 1, SamplingParams())], [1]))  # preempted: not scheduled
    seq.num_computed_tokens = 0  # recompute from the start
    rows.step(ScheduledBatch([seq], [10]))
    assert calls == [4, 4]
