"""The CUDA backend: the torch backend's operations, with paged attention in a Triton kernel and
quantized linears on CUDA kernels.

Tested on an NVIDIA H200 (tests/engine/test_cuda.py, tests/e2e/test_cuda_e2e.py; .ci/cuda runs them
where a GPU is lent, CI has none). Dense linears are the torch backend's (cuBLAS). Attention is
engine/kernels/triton_attention.py's kernel where triton imports and it takes the dtype and head
size (every sequence of a step, decodes and prefill chunks, read in place through the block
tables: AttentionPath.PAGED_TILES); else, and for float64, chunked windows (Llama 4) and the
batch-invariant mode, torch's SDPA over gathered blocks. A quantized weight gets engine.quant.cuda's
linear for this device's compute capability (fp8 through torch._scaled_mm, int4 through tinygemm,
the rest dequantized per tile).
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.backends.base import AttentionMetadata, AttentionPath, HeadLayout, KVCache, Linear, PagedTiles
from engine.backends.torch_ops import TorchBackend
from engine.executor.step_inputs import StepInputs
from engine.kernels import triton_attention
from engine.quant.cuda import Capability, make_cuda_linear
from engine.quant.formats import QuantizedWeight


# SDPA's kernels without cuDNN's: its attention builds an execution plan for each new key length,
# which a decode step brings every time. On an H200 (torch 2.11) that took 330 us of host time per
# call, 4.7 ms of a 12.8 ms batch-1 step of a 1.1B model (bench/cuda_step_profile.py); the others
# have no per-shape setup. MATH serves float64.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def device_capability(device: torch.device) -> Capability | None:
    """The CUDA compute capability of `device`; None where torch has no CUDA device to ask."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


class CudaBackend(TorchBackend):
    name = "cuda"

    def __init__(self, device: torch.device, dtype: torch.dtype, *, quantization: str | None = None,
                 batch_invariant: bool = False, capability: Capability | None = None,
                 paged_kernel: bool | None = None) -> None:  # fmt: skip
        super().__init__(device, dtype, quantization=quantization, batch_invariant=batch_invariant)
        self.capability = capability
        # the Triton kernel: on a CUDA device where triton imports (None), or as a test says (its CPU
        # runs under the interpreter); never in the batch-invariant mode, whose decodes are per sequence
        if paged_kernel is None:
            paged_kernel = device.type == "cuda" and triton_attention.triton_available()
        self.paged_kernel = paged_kernel and not batch_invariant

    def attention_metadata(self, inputs: StepInputs, freqs_cis: torch.Tensor, cache: KVCache, chunk_size: int | None = None) -> AttentionMetadata:
        """Every sequence in one Triton kernel (PAGED_TILES) where it takes the cache's dtype and head
        size and no chunk window applies; else the torch backend's layout."""
        if not (self.paged_kernel and chunk_size is None and triton_attention.supports(cache[0].dtype, cache[0].shape[3])):
            return super().attention_metadata(inputs, freqs_cis, cache, chunk_size)
        rope = freqs_cis.index_select(0, inputs.positions).unsqueeze(1)  # torch's rope_and_cache_write
        return AttentionMetadata(AttentionPath.PAGED_TILES, inputs.positions, inputs.slot_mapping, [], paged_tiles(inputs), rope)

    def captures_decode_steps(self, dtype: torch.dtype, head_dim: int) -> bool:
        """On the Triton path: a pure-decode step's tiles come from the shapes (paged_tiles)."""
        return self.paged_kernel and triton_attention.supports(dtype, head_dim)

    def attention(self, qkv: torch.Tensor, heads: HeadLayout, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.path is AttentionPath.PAGED_TILES:
            tiles = meta.batched
            out = torch.empty(qkv.shape[0], heads.heads * heads.head_dim, dtype=qkv.dtype, device=qkv.device)
            triton_attention.paged_attention(
                qkv.contiguous(), out, *cache, block_tables=tiles.block_tables, seq_lens=tiles.seq_lens,
                query_start_loc=tiles.query_start_loc, tile_seq=tiles.tile_seq, tile_first=tiles.tile_first,
                tile_tokens=tiles.tile_tokens, heads=heads.heads, kv_heads=heads.kv_heads, head_dim=heads.head_dim,
                scale=heads.head_dim**-0.5,
            )  # fmt: skip
            return out
        with sdpa_kernel(SDPA_BACKENDS):
            return super().attention(qkv, heads, cache, meta)

    def special_linear(self, weight) -> Linear:
        if isinstance(weight, QuantizedWeight):
            return make_cuda_linear(weight, self.capability)
        return super().special_linear(weight)


def paged_tiles(inputs: StepInputs) -> PagedTiles:
    """The kernel's tiles for a step. A pure-decode step (one new token per sequence, known from the
    shapes) gets one tile per sequence with no read of the device's tensors, so a CUDA graph can
    capture it; a step with prefill chunks reads its new-token counts once (as the torch path's
    AttentionMetadata.split does) and cuts them into PREFILL_TILE_TOKENS-token tiles."""
    device = inputs.seq_lens.device
    num_seqs = inputs.num_seqs
    if inputs.num_tokens == num_seqs:
        tile_tokens = 1
        tile_seq = torch.arange(num_seqs, dtype=torch.int32, device=device)
        tile_first = torch.zeros_like(tile_seq)
    else:
        tile_tokens = triton_attention.PREFILL_TILE_TOKENS
        counts = (inputs.query_start_loc[1:] - inputs.query_start_loc[:-1]).tolist()
        tile_seq, tile_first = torch.tensor(triton_attention.tile_map(counts, tile_tokens), dtype=torch.int32).to(device)
    return PagedTiles(inputs.block_tables.contiguous(), inputs.seq_lens.contiguous(), inputs.query_start_loc.contiguous(),
                      tile_seq, tile_first, tile_tokens)  # fmt: skip
