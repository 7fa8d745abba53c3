"""engine/models/llama4/vision.py equals llama-models' Llama 4 VisionEmbeddings + vision_projection
(fairscale group of one, .cuda() as identity, float64), for one- and many-chunk images."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from engine.models.llama4.vision import Llama4VisionEncoder, VisionConfig, random_vision_state
from engine.vision.llama4 import Llama4ImagePreprocessor
from tests.llama4_vision_fixtures import TINY_VISION_ARGS, random_image

TEXT_DIM = 64


@pytest.fixture(scope="module")
def reference_embed():
    pytest.importorskip("llama_models.llama4.model")
    from llama_models.llama4.args import VisionArgs
    from llama_models.llama4.vision.embedding import VisionEmbeddings

    from engine.executor.parallel import destroy_group, init_group

    init_group(torch.device("cpu"), rank=0, world_size=1, init_method="tcp://127.0.0.1:0", timeout_s=60)
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # the reference's attention caches call .cuda()
    try:
        embeddings = VisionEmbeddings(VisionArgs(**TINY_VISION_ARGS)).double()
        projection = torch.nn.Linear(TINY_VISION_ARGS["output_dim"], TEXT_DIM, bias=False).double()

        def run(state: dict[str, torch.Tensor], tiles: torch.Tensor) -> torch.Tensor:
            prefix = "vision_embeddings."
            missing, unexpected = embeddings.load_state_dict(
                {k[len(prefix):]: v.double() for k, v in state.items() if k.startswith(prefix)}, strict=False)
            assert not unexpected and all("cache" in k for k in missing), (missing, unexpected)
            projection.weight.data.copy_(state["vision_projection.weight"].double())
            rows = tiles.shape[0] * 4  # tokens per chunk: (32 / 8)^2 / 4
            mask = torch.ones(1, rows, 1, dtype=torch.bool)
            with torch.inference_mode():
                h_image = embeddings([[tiles.double()]], mask, torch.zeros(1, rows, TEXT_DIM, dtype=torch.float64))
                return projection(h_image)[0]

        yield run
    finally:
        torch.Tensor.cuda = cuda
        destroy_group()


@pytest.mark.parametrize("size", [(20, 12), (100, 30)])
def test_vision_rows_equal_the_reference(reference_embed, size):
    config = VisionConfig.from_params(TINY_VISION_ARGS)
    state = random_vision_state(config, output_dim=TINY_VISION_ARGS["output_dim"], mlp_ratio=TINY_VISION_ARGS["mlp_ratio"],
                                text_dim=TEXT_DIM, seed=sum(size), dtype=torch.float64)
    image = Image.open(io.BytesIO(random_image(*size, seed=1))).convert("RGB")
    tiles = Llama4ImagePreprocessor(tile_size=32, patch_size=8, pixel_shuffle_ratio=0.5).preprocess(image).pixels
    ours = Llama4VisionEncoder(config, state)(tiles)
    expected = reference_embed(state, tiles)
    assert ours.shape == (tiles.shape[0] * 4, TEXT_DIM)
    assert ours.abs().max() > 0.1  # not a degenerate all-zero comparison
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-6)  # the reference's RoPE runs in float32


def test_fp8_mixed_leaves_the_vision_weights_unquantized(tmp_path):
    """llama-models' Llama 4 quantization (quantization/loader.py) converts the MoE experts only: under
    fp8_mixed the vision encoder runs in bfloat16, and its rows stay close to float32's."""
    import torch.nn.functional as F

    from engine.config import EngineConfig
    from engine.executor.worker_group import WorkerGroup
    from engine.loading.checkpoint import resolve_checkpoint
    from tests.engine.tokenizer_fixtures import llama_models_file
    from tests.llama4_fixtures import TINY_LLAMA4_DESCRIPTOR
    from tests.llama4_vision_fixtures import write_tiny_llama4_vision_checkpoint

    ckpt = write_tiny_llama4_vision_checkpoint(tmp_path, tokenizer_path=llama_models_file("llama4/tokenizer.model"))
    spec = resolve_checkpoint(ckpt, model_id="v", llama_model=TINY_LLAMA4_DESCRIPTOR)
    image = Image.open(io.BytesIO(random_image(100, 30, seed=3))).convert("RGB")
    tiles = Llama4ImagePreprocessor(tile_size=32, patch_size=8, pixel_shuffle_ratio=0.5).preprocess(image).pixels
    rows = {}
    for dtype, quantization in (("float32", None), ("bfloat16", "fp8_mixed")):
        group = WorkerGroup(spec, EngineConfig(dtype=dtype, quantization=quantization, cpu_kv_cache_bytes=1 << 20,
                                               max_batch_size=1), max_seq_len=64)
        try:
            weights = group._shard.image_encoder.w  # rank 0's (here: all of) the vision weights
            assert all(type(t) is torch.Tensor and t.dtype == getattr(torch, dtype) for t in weights.values())
            rows[dtype] = group.image_encoder(tiles).double()
        finally:
            group.shutdown()
    assert F.cosine_similarity(rows["bfloat16"], rows["float32"], dim=-1).min() > 0.99
