"""The Triton paged-attention kernel (engine/kernels/triton_attention.py) against torch's attention
(engine/backends/torch_ops.py), run on CPU tensors under Triton's interpreter: decodes and prefill
chunks over cached prefixes, sequences crossing block boundaries, GQA ratios, mixed batches, in
float32. Skipped where triton is not installed (the optional `cuda` extra); on a GPU the same
comparison runs through the CUDA backend (tests/engine/test_cuda.py).

The interpreter is chosen by TRITON_INTERPRET when triton is imported, for the whole process; so
test_kernel_under_the_interpreter runs this file's kernel tests in a Python of their own with it set,
and the process running the suite (a GPU's too) keeps compiled kernels."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.backends.base import AttentionPath, HeadLayout
from engine.backends.torch_ops import TorchBackend
from engine.executor.step_inputs import StepInputs
from engine.kernels import triton_attention
from engine.kernels.triton_attention import PREFILL_TILE_TOKENS, rows_per_tile, tile_map
from engine.models.llama import precompute_freqs_cis

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not triton_attention.triton_available(), reason="triton is not installed (pip install '.[cuda]')")
interpreted = pytest.mark.skipif(not INTERPRETED, reason="run under TRITON_INTERPRET=1 by test_kernel_under_the_interpreter")
NUM_KERNEL_TESTS = 10  # the @interpreted cases below, parametrizations counted


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter's run")
def test_kernel_under_the_interpreter():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(Path(__file__))],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed is not None and int(passed.group(1)) == NUM_KERNEL_TESTS + 1, report  # + test_tile_map_and_rows


BLOCK_SIZE = 4
HEAD_DIM = 16
NUM_BLOCKS = 64
MAX_SEQ_LEN = 128


def paged_step(seqs: list[tuple[int, int]], heads: HeadLayout, *, seed: int) -> tuple[StepInputs, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A step over sequences given as (cached prefix, new tokens), each on blocks drawn at random
    from the pool (so a sequence's blocks are neither contiguous nor in order): the step inputs,
    qkv [tokens, (heads + 2 kv_heads) * head_dim], and a cache holding every key of the step, the
    prefixes' random ones and the new tokens' (as rope_and_cache_write leaves it)."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(1, NUM_BLOCKS))  # block 0 stays unused: padding of the tables points there
    random.Random(seed).shuffle(free)
    shape = (NUM_BLOCKS, BLOCK_SIZE, heads.kv_heads, heads.head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables, positions, slots, starts, seq_lens = [], [], [], [0], []
    for prefix, new in seqs:
        kv_len = prefix + new
        table = [free.pop() for _ in range(-(-kv_len // BLOCK_SIZE))]
        tables.append(table)
        positions += range(prefix, kv_len)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(prefix, kv_len)]
        starts.append(starts[-1] + new)
        seq_lens.append(kv_len)
    width = max(map(len, tables))
    num_tokens = starts[-1]
    qkv = torch.randn(num_tokens, (heads.heads + 2 * heads.kv_heads) * heads.head_dim, generator=gen)
    rows = qkv.view(num_tokens, -1, heads.head_dim)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    k_cache.view(-1, heads.kv_heads, heads.head_dim)[slot_t] = rows[:, heads.heads : heads.heads + heads.kv_heads]
    v_cache.view(-1, heads.kv_heads, heads.head_dim)[slot_t] = rows[:, heads.heads + heads.kv_heads :]
    inputs = StepInputs(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=slot_t,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        logits_indices=torch.tensor([s - 1 for s in starts[1:]], dtype=torch.int64),
    )
    return inputs, qkv, (k_cache, v_cache)


def torch_attention(inputs: StepInputs, qkv: torch.Tensor, heads: HeadLayout, cache) -> torch.Tensor:
    backend = TorchBackend(torch.device("cpu"), torch.float32)
    freqs = precompute_freqs_cis(heads.head_dim, MAX_SEQ_LEN, 500000.0, False)
    return backend.attention(qkv, heads, cache, backend.attention_metadata(inputs, freqs, cache))


def triton_paged(inputs: StepInputs, qkv: torch.Tensor, heads: HeadLayout, cache, tile_tokens: int) -> torch.Tensor:
    counts = (inputs.query_start_loc[1:] - inputs.query_start_loc[:-1]).tolist()
    tile_seq, tile_first = tile_map(counts, tile_tokens)
    out = torch.full((qkv.shape[0], heads.heads * heads.head_dim), float("nan"))
    triton_attention.paged_attention(
        qkv, out, *cache, block_tables=inputs.block_tables, seq_lens=inputs.seq_lens, query_start_loc=inputs.query_start_loc,
        tile_seq=torch.tensor(tile_seq, dtype=torch.int32), tile_first=torch.tensor(tile_first, dtype=torch.int32),
        tile_tokens=tile_tokens, heads=heads.heads, kv_heads=heads.kv_heads, head_dim=heads.head_dim, scale=heads.head_dim**-0.5,
    )  # fmt: skip
    return out


GQA = [HeadLayout(4, 4, HEAD_DIM), HeadLayout(4, 2, HEAD_DIM), HeadLayout(8, 2, HEAD_DIM), HeadLayout(6, 2, HEAD_DIM)]


@interpreted
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h.heads}q{h.kv_heads}kv")
def test_decodes_of_lengths_crossing_blocks(heads):
    """One new token per sequence at K/V lengths on, just past and far past block boundaries (the
    longest past BLOCK_N keys, so the kernel's key loop runs more than once)."""
    seqs = [(kv_len - 1, 1) for kv_len in (1, 3, 4, 5, 8, 9, 33, 70)]
    inputs, qkv, cache = paged_step(seqs, heads, seed=1)
    expected = torch_attention(inputs, qkv, heads, cache)
    torch.testing.assert_close(triton_paged(inputs, qkv, heads, cache, tile_tokens=1), expected, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("heads", GQA[1:3], ids=lambda h: f"{h.heads}q{h.kv_heads}kv")
def test_prefill_chunks_over_cached_prefixes_mixed_with_decodes(heads):
    """A fresh prompt longer than a tile, a chunk after a prefix hit that ends mid-block, a chunk
    after a block-aligned prefix, a 2-token chunk, and decodes, in one step: each query attends
    its cached prefix and the causal part of its own chunk."""
    seqs = [(0, 37), (6, 11), (8, 20), (13, 2), (20, 1), (0, 1), (44, 1)]
    inputs, qkv, cache = paged_step(seqs, heads, seed=2)
    expected = torch_attention(inputs, qkv, heads, cache)
    torch.testing.assert_close(triton_paged(inputs, qkv, heads, cache, PREFILL_TILE_TOKENS), expected, rtol=1e-5, atol=1e-5)


@interpreted
def test_every_row_written_once_whatever_the_tile_size():
    """Tiles of 1, 3 and 16 tokens give the same result: tiles cover every new token exactly once
    (the output starts as NaN, so a row no tile wrote would fail)."""
    heads = GQA[1]
    inputs, qkv, cache = paged_step([(5, 7), (0, 16), (2, 1)], heads, seed=3)
    expected = torch_attention(inputs, qkv, heads, cache)
    for tile_tokens in (1, 3, 16):
        torch.testing.assert_close(triton_paged(inputs, qkv, heads, cache, tile_tokens), expected, rtol=1e-5, atol=1e-5)


def test_tile_map_and_rows():
    assert tile_map([1, 37, 16, 1], 16) == ([0, 1, 1, 1, 2, 3], [0, 0, 16, 32, 0, 0])
    assert rows_per_tile(1, 4) == 16  # tl.dot's smallest M
    assert rows_per_tile(16, 3) == 64  # 3 query heads per KV head padded to 4
    assert rows_per_tile(1, 32) == 32


@interpreted
@pytest.mark.parametrize("seqs", [[(4, 1), (0, 1), (30, 1)], [(0, 9), (3, 1), (16, 5)]], ids=["decodes", "mixed"])
def test_cuda_backend_attends_through_the_kernel(seqs):
    """The CUDA backend's layout (its pure-decode tiles without reading device tensors, its prefill
    tiles from the counts) and its attention call, here on CPU tensors: equal to the torch backend's."""
    from engine.backends.cuda import CudaBackend

    heads = GQA[2]
    inputs, qkv, cache = paged_step(seqs, heads, seed=4)
    backend = CudaBackend(torch.device("cpu"), torch.float32, paged_kernel=True)
    freqs = precompute_freqs_cis(heads.head_dim, MAX_SEQ_LEN, 500000.0, False)
    meta = backend.attention_metadata(inputs, freqs, cache)
    assert meta.path is AttentionPath.PAGED_TILES and meta.batched.tile_tokens == (1 if seqs[0][1] == 1 else PREFILL_TILE_TOKENS)
    torch.testing.assert_close(backend.attention(qkv, heads, cache, meta), torch_attention(inputs, qkv, heads, cache), rtol=1e-5, atol=1e-5)
    # float64, a chunk window, the batch-invariant mode: torch's layout
    assert backend.attention_metadata(inputs, freqs, cache, chunk_size=8).path is AttentionPath.GATHERED
    double = tuple(c.double() for c in cache)
    assert backend.attention_metadata(inputs, freqs, double).path is AttentionPath.GATHERED
    invariant = CudaBackend(torch.device("cpu"), torch.float32, paged_kernel=True, batch_invariant=True)
    assert invariant.attention_metadata(inputs, freqs, cache).path is AttentionPath.GATHERED


@interpreted
def test_a_model_on_the_cuda_backend_equals_it_on_the_torch_backend(tiny_checkpoint, monkeypatch):
    """The tiny model's forward with the CUDA backend's Triton attention (here on CPU tensors) against
    the torch backend's, over a prefill, a pure-decode step and a step mixing a chunk over a cached
    prefix with decodes. The pure-decode step's plan reads no tensor on the host (what lets a CUDA
    graph capture it: tolist and item raise while it is planned)."""
    from engine.backends.cuda import CudaBackend
    from engine.core.sequence import ScheduledBatch, Sequence
    from engine.executor.executor import build_step_inputs
    from engine.loading.checkpoint import load_rank_state_dict, resolve_checkpoint
    from engine.models.llama import Transformer, allocate_kv_caches
    from engine.types import SamplingParams
    from tests.conftest import TINY_DESCRIPTOR
    from tests.engine.test_model import random_prompts

    spec = resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    args = spec.model_args
    state = {k: v.float() for k, v in load_rank_state_dict(spec, 0, 1).items()}
    cpu = torch.device("cpu")
    models = [Transformer.from_state_dict(args, dict(state), backend, max_seq_len=MAX_SEQ_LEN)
              for backend in (CudaBackend(cpu, torch.float32, paged_kernel=True), TorchBackend(cpu, torch.float32))]  # fmt: skip
    caches = [allocate_kv_caches(args, 1, NUM_BLOCKS, BLOCK_SIZE, dtype=torch.float32, device=cpu) for _ in models]
    free = list(range(NUM_BLOCKS))
    random.Random(0).shuffle(free)
    prompts = random_prompts(args.vocab_size, [9, 5, 14], seed=3)
    seqs = [Sequence(i, f"m{i}", p, len(p), SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]

    def step(counts: list[int], *, no_host_reads: bool = False) -> None:
        for seq, count in zip(seqs, counts):
            while len(seq.block_table) * BLOCK_SIZE < seq.num_computed_tokens + count:
                seq.block_table.append(free.pop())
        running = [(s, c) for s, c in zip(seqs, counts) if c]
        inputs, sampling = build_step_inputs(ScheduledBatch([s for s, _ in running], [c for _, c in running]), BLOCK_SIZE)
        if no_host_reads:
            plan = models[0].backend.plan_step
            with monkeypatch.context() as patch:
                for name in ("tolist", "item"):
                    patch.setattr(torch.Tensor, name, lambda *a, name=name: pytest.fail(f"{name}() while planning a decode step"))
                assert plan(inputs, models[0].freqs_cis, caches[0][0], None).attention.path is AttentionPath.PAGED_TILES
        triton_logits, torch_logits = (model(inputs, cache) for model, cache in zip(models, caches))
        torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-4, atol=1e-4)
        for seq, count in running:
            seq.num_computed_tokens += count
        for row, i in enumerate(sampling):  # the greedy token of each sequence that reached its end
            running[i][0].token_ids.append(int(torch_logits[row].argmax()))

    step([9, 5, 6])  # two prompts whole, the third's first 6 tokens
    step([1, 1, 0], no_host_reads=True)  # decodes only
    step([1, 1, 8])  # the third's remaining 8 tokens over its 6 cached ones, beside two decodes
    step([1, 1, 1], no_host_reads=True)
