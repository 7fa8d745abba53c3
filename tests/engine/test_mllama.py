"""Llama 3.2 Vision (engine/models/mllama/) against llama-models' own multimodal reference.

A tiny random checkpoint in Meta's release layout (one unnumbered consolidated.pth, the reference's
key names; tests/mllama_fixtures.py) is loaded by our loader and by llama-models'
CrossAttentionTransformer (its encoder width, hard-coded 1280, set to the tiny one). The reference
runs each prompt as one full recompute (compute_vision_tokens_masks + forward from position 0); ours
runs prefill chunks and decodes through the paged cache with the per-sequence cross-attention state.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from engine.config import EngineConfig
from engine.backends import select_backend
from engine.core.sequence import ScheduledBatch, Sequence
from engine.executor.executor import build_step_inputs
from engine.loading.checkpoint import load_rank_state_dict, resolve_checkpoint
from engine.models.llama import allocate_kv_caches
from engine.models.mllama.model import MllamaTransformer
from engine.vision.mllama import MllamaImagePreprocessor, stack_tiles, transform_image, vision_spans
from engine.types import SamplingParams
from tests.engine.test_model import BlockAllocator
from tests.mllama_fixtures import TINY_VISION_DESCRIPTOR, install_torchvision_shim, reference_model, write_tiny_vision_checkpoint

BLOCK = 4
VOCAB = 256
IMAGE = VOCAB  # <|image|> past the text vocabulary, as 128256 is in the release


def image(width: int, height: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_vision_checkpoint(tmp_path_factory.mktemp("mllama"))


@pytest.fixture(scope="module")
def ours(checkpoint):
    spec = resolve_checkpoint(checkpoint, model_id="tiny-vision", llama_model=TINY_VISION_DESCRIPTOR)
    config = EngineConfig(dtype="float32", cpu_kernels=False)
    backend = select_backend(config, torch.device("cpu"))
    state = {k: v.float() for k, v in load_rank_state_dict(spec, 0, 1).items()}
    model = MllamaTransformer.from_state_dict(spec.model_args, state, backend, mp_size=1, max_seq_len=64)
    return model


@pytest.fixture(scope="module")
def reference(checkpoint):
    with reference_model(checkpoint) as model:
        def logits(tokens: list[int], images: list[Image.Image]) -> torch.Tensor:
            total = len(tokens)
            mask = [list(span) for span in vision_spans_reference(tokens)]
            xattn, masks, rows = model.compute_vision_tokens_masks([images], [mask], total, torch.device("cpu"))
            positions = torch.arange(total)
            return model.forward(positions, torch.tensor([tokens]), masks, rows, xattn, text_only_inference=not images)[0]

        yield logits


def vision_spans_reference(tokens: list[int]) -> list[list[int]]:
    from llama_models.llama3.chat_format import create_vision_mask

    return create_vision_mask(tokens, IMAGE)


def run_ours(model, prompts: list[tuple[list[int], list[Image.Image]]], chunk: int) -> list[torch.Tensor]:
    """Every position's logits for each prompt, prefilled `chunk` tokens a step, all prompts in each step."""
    kv = allocate_kv_caches(model.params, 1, 64, BLOCK, dtype=torch.float32, device=torch.device("cpu"))
    alloc = BlockAllocator(64, 0)
    seqs = [Sequence(i, f"r{i}", list(t), len(t), SamplingParams(temperature=0.0)) for i, (t, _) in enumerate(prompts)]
    cross = []
    for tokens, images in prompts:
        if not images:
            cross.append(None)
            continue
        tiles = [transform_image(im, size=28, max_num_chunks=4) for im in images]
        cross.append(model.cross_attention_state(stack_tiles([t for t, _ in tiles], 4, 28), [ar for _, ar in tiles],
                                                 vision_spans([i for i, t in enumerate(tokens) if t == IMAGE], len(tokens))))  # fmt: skip
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(s.num_uncomputed_tokens for s in seqs):
        step = [s for s in seqs if s.num_uncomputed_tokens]
        counts = [min(chunk, s.num_uncomputed_tokens) for s in step]
        for s, c in zip(step, counts):
            alloc.grow(s, s.num_computed_tokens + c)
        inputs, _ = build_step_inputs(ScheduledBatch(step, counts), BLOCK)
        inputs = dataclasses.replace(inputs, logits_indices=torch.arange(inputs.num_tokens))
        logits = model(inputs, kv, [cross[s.seq_id] for s in step])
        row = 0
        for s, c in zip(step, counts):
            out[s.seq_id].append(logits[row : row + c])
            row += c
            s.num_computed_tokens += c
    return [torch.cat(o) for o in out]


PROMPTS = [
    ([1, 5, IMAGE, 7, 9, 11, 13, 2, 3], [(40, 20)]),  # one image: text before it attends nothing
    ([1, IMAGE, IMAGE, 4, 6, IMAGE, 8, 10, 12], [(30, 30), (60, 20), (10, 50)]),  # consecutive and several
    ([1, 3, 5, 7, 9, 11], []),  # text only
]


@pytest.mark.parametrize("chunk", [3, 64])
def test_logits_match_llama_models_reference(ours, reference, chunk):
    prompts = [(tokens, [image(w, h, seed) for seed, (w, h) in enumerate(sizes)]) for tokens, sizes in PROMPTS]
    got = run_ours(ours, prompts, chunk)
    for (tokens, images), logits in zip(prompts, got):
        expected = reference(tokens, images)
        torch.testing.assert_close(logits, expected, atol=2e-3, rtol=0)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_images_change_the_answer_only_where_attended(ours):
    """The test above cannot pass vacuously: another image changes the logits of the rows that
    attend it (from its <|image|> on), and none before."""
    tokens = PROMPTS[0][0]
    first, second = (run_ours(ours, [(tokens, [image(40, 20, seed)])], 64)[0] for seed in (0, 1))
    start = tokens.index(IMAGE)
    assert torch.equal(first[:start], second[:start])
    assert (first[start:] - second[start:]).abs().max() > 1e-2


def test_preprocessing_matches_llama_models_transform():
    install_torchvision_shim()
    from llama_models.llama3.multimodal.image_transform import VariableSizeImageTransform

    transform = VariableSizeImageTransform(size=28)
    for w, h in [(40, 20), (28, 28), (10, 50), (100, 7), (57, 83), (300, 200)]:
        for chunks in (1, 2, 4, 6):
            im = image(w, h, w * h)
            expected, expected_ar = transform(im, max_num_chunks=chunks)
            got, ar = transform_image(im, size=28, max_num_chunks=chunks)
            assert ar == tuple(expected_ar)
            assert torch.equal(got, expected), (w, h, chunks)
            prepared = MllamaImagePreprocessor(chunk_size=28, max_num_chunks=chunks).preprocess(im)
            assert torch.equal(prepared.pixels, expected) and prepared.aspect_ratio == ar
            assert prepared.num_chunks == ar[0] * ar[1] and prepared.tokens_per_chunk == 0  # one <|image|> token


def test_vision_spans_match_create_vision_mask():
    for tokens in ([1, IMAGE, 2], [1, 2], [IMAGE, IMAGE, 3, IMAGE, 4], [1, IMAGE, 2, IMAGE, 3, IMAGE, IMAGE]):
        locations = [i for i, t in enumerate(tokens) if t == IMAGE]
        assert [list(s) for s in vision_spans(locations, len(tokens))] == vision_spans_reference(tokens)


def test_prompt_tokens_with_images_equal_llama_models_chat_format():
    """Our Llama 3.2 chat format places <|image|> (128011) as llama-models' ChatFormat does; its
    LLMInput then feeds 128256, which the engine does at the placement (test_mllama_engine.py)."""
    import io

    from llama_models.datatypes import RawMediaItem, RawMessage, RawTextItem
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer as Reference

    from engine.chat.format import make_chat_format
    from engine.types import ChatMessage, PreparedImage
    from tests.engine.tokenizer_fixtures import llama_models_file, real_llama3

    def png(seed: int) -> bytes:
        out = io.BytesIO()
        image(40, 20, seed).save(out, format="PNG")
        return out.getvalue()

    reference = ChatFormat(Reference(llama_models_file("llama3/tokenizer.model")))
    prepared = [PreparedImage(bytes(32), (1, 2), 2, 0, None) for _ in range(3)]
    ours = make_chat_format("llama3_2", real_llama3())
    dialogs = [
        [("user", [prepared[0], "Describe this image."])],
        [("system", ["Be brief."]), ("user", ["Compare", prepared[0], "with", prepared[1], prepared[2], "now"]),
         ("assistant", ["Same."]), ("user", ["Sure?"])],
    ]
    for dialog in dialogs:
        raw = [RawMessage(role=role, content=[RawMediaItem(data=png(i)) if isinstance(p, PreparedImage) else RawTextItem(text=p)
                                             for i, p in enumerate(parts)]) for role, parts in dialog]  # fmt: skip
        expected = reference.encode_dialog_prompt(raw)
        prompt = ours.encode_prompt([ChatMessage(role, "".join(p for p in parts if isinstance(p, str)), parts=tuple(parts))
                                     for role, parts in dialog])  # fmt: skip
        marker = reference.tokenizer.special_tokens["<|image|>"]
        assert prompt.ids == [marker if t == 128256 else t for t in expected.tokens]
        assert [p.offset for p in prompt.images] == [i for i, t in enumerate(prompt.ids) if t == marker]
        assert len(expected.vision.images) == len(prompt.images)


def test_encoder_sizes_come_from_the_weights(checkpoint):
    """The tiny encoder (width 32) is read from the checkpoint's shapes, for loading and for the
    memory estimate; without the weights the estimate is the released encoder's."""
    from engine.loading.checkpoint import checkpoint_vision_dims, estimate_weight_bytes, parameter_count
    from tests.mllama_fixtures import tiny_vision_dims

    spec = resolve_checkpoint(checkpoint, model_id="tiny-vision", llama_model=TINY_VISION_DESCRIPTOR)
    dims = checkpoint_vision_dims(spec)
    assert dims == tiny_vision_dims()
    on_disk = sum(t.numel() for t in torch.load(checkpoint / "consolidated.pth", weights_only=True).values())
    assert parameter_count(spec.model_args, dims) == on_disk
    assert estimate_weight_bytes(spec.model_args, torch.float32, dims) == 4 * on_disk
    assert parameter_count(spec.model_args) > 100 * on_disk  # the released 1280-wide encoder


def test_numbered_shards_load_as_the_unnumbered_file(checkpoint, tmp_path):
    """The 90B release's consolidated.NN.pth (model-parallel shards, split as the reference's
    fairscale layers split them) load to the same weights as the 11B release's single consolidated.pth."""
    sharded = write_tiny_vision_checkpoint(tmp_path / "two", num_shards=2)
    assert sorted(p.name for p in sharded.glob("*.pth")) == ["consolidated.00.pth", "consolidated.01.pth"]
    one = load_rank_state_dict(resolve_checkpoint(checkpoint, model_id="a", llama_model=TINY_VISION_DESCRIPTOR), 0, 1)
    two = load_rank_state_dict(resolve_checkpoint(sharded, model_id="b", llama_model=TINY_VISION_DESCRIPTOR), 0, 1)
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    half = torch.load(sharded / "consolidated.00.pth", weights_only=True)
    assert half["vision_model.vision_encoder.transformer.resblocks.0.attn.wq.weight"].shape[0] == 16  # width 32 / 2
    assert half["text_model.cross_attention_layers.0.attention.wo.weight"].shape[1] == 32  # row-parallel: dim 64 / 2
