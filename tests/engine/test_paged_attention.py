"""engine.kernels.cpu' paged_attention (one call for a step's prefill chunks and decodes) against
float64 torch maths on random paged caches, and the CPU backend's forward with it against the torch
backend's greedy tokens."""

from __future__ import annotations

import subprocess

import pytest
import torch

from engine.kernels import build
from engine.kernels import cpu as ck

THREADS = 2


@pytest.fixture(scope="module")


def kernels() -> ck.CpuKernels:
    loaded = ck.load_cpu_kernels()
    if loaded is None:
        pytest.skip("fused CPU kernels could not be built here (no working C compiler?)")
    return loaded


def paged_batch(new_tokens: list[int], kv_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, dtype, seed: int):
    """qkv rows for the new tokens, a cache holding every sequence's keys in shuffled blocks (NaN in
    every slot no sequence owns, so a read outside a sequence shows), and the int32 index tensors."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in kv_lens]
    max_blocks, num_blocks = max(blocks_per_seq), sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[pool.pop() for _ in range(n)] + [0] * (max_blocks - n) for n in blocks_per_seq]
    k_cache, v_cache = nan_filled_caches(tables, kv_lens, num_blocks, block_size, kv_heads, head_dim, dtype, g)
    qkv = torch.randn(sum(new_tokens), (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    starts = [0]
    for n in new_tokens:
        starts.append(starts[-1] + n)
    index = (
        torch.tensor(starts[:-1], dtype=torch.int32),
        torch.tensor(new_tokens, dtype=torch.int32),
        torch.tensor(kv_lens, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
    )
    return qkv, k_cache, v_cache, index


def reference(qkv, k_cache, v_cache, index, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """float64 causal attention, sequence by sequence, K/V heads repeated (the model's repeat_kv)."""
    starts, counts, kv_lens, tables = (t.tolist() for t in index)
    block_size, n_rep, scale = k_cache.shape[1], heads // kv_heads, head_dim**-0.5
    out = torch.empty(qkv.shape[0], heads * head_dim, dtype=torch.float64)
    for b, kv_len in enumerate(kv_lens):
        n_new = counts[b]
        ids = torch.tensor(tables[b][: -(-kv_len // block_size)])
        keys = k_cache[ids].reshape(-1, kv_heads, head_dim)[:kv_len].double().repeat_interleave(n_rep, dim=1)
        values = v_cache[ids].reshape(-1, kv_heads, head_dim)[:kv_len].double().repeat_interleave(n_rep, dim=1)
        q = qkv[starts[b] : starts[b] + n_new, : heads * head_dim].double().view(n_new, heads, head_dim)
        scores = torch.einsum("thd,khd->thk", q, keys) * scale
        positions = torch.arange(kv_len - n_new, kv_len)[:, None, None]
        scores = scores.masked_fill(torch.arange(kv_len)[None, None, :] > positions, float("-inf"))
        out[starts[b] : starts[b] + n_new] = torch.einsum("thk,khd->thd", scores.softmax(-1), values).reshape(n_new, -1)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)
    else:  # inputs already bf16: only the output's rounding and float32 sums differ
        torch.testing.assert_close(actual.double(), expected, atol=1e-2, rtol=1.6e-2)


# (new tokens, K/V lengths): prefills without a prefix, with one (odd lengths, across blocks),
# decodes, a step mixing them, decodes first and last, and long chunks (AVX2: many query rows per
# item go through the small-GEMM tiles) behind prefixes off the 16-key runs, so the causal diagonal
# cuts runs and row vectors at odd places
BATCHES = {
    "prefill": ([7, 1, 33, 16], [7, 1, 33, 16]),
    "prefix": ([5, 20, 3], [21, 52, 3 + 16]),
    "decodes": ([1, 1, 1, 1, 1], [1, 15, 16, 17, 100]),
    "mixed": ([1, 40, 1, 9, 1], [30, 57, 1, 9, 64]),
    "long": ([100, 1, 37], [130, 50, 37 + 21]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# n_rep 3 (the demo), 4, 1, 8, 24 and 64 (more query heads per KV head than a tile's 48 rows)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (8, 1, 32), (24, 1, 16), (64, 1, 32)], ids=str)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_paged_attention_matches_reference(kernels, dtype, heads, kv_heads, head_dim, batch):
    new_tokens, kv_lens = BATCHES[batch]
    qkv, k_cache, v_cache, index = paged_batch(new_tokens, kv_lens, heads, kv_heads, head_dim, 16, dtype, seed=heads + head_dim)
    out = torch.full((qkv.shape[0], heads * head_dim), 123.0, dtype=dtype)
    kernels.paged_attention(qkv, out, *index, k_cache, v_cache, heads, kv_heads, head_dim**-0.5, THREADS)
    assert_close(out, reference(qkv, k_cache, v_cache, index, heads, kv_heads, head_dim), dtype)


@pytest.mark.parametrize("block_size", [1, 8, 24, 32])
def test_paged_attention_block_sizes(kernels, block_size):
    """Blocks smaller than, not a multiple of, and larger than the kernel's 16-key runs."""
    heads, kv_heads, head_dim = 6, 2, 64
    qkv, k_cache, v_cache, index = paged_batch([1, 30, 7], [50, 45, 7], heads, kv_heads, head_dim, block_size, torch.float32, seed=block_size)
    out = torch.empty(qkv.shape[0], heads * head_dim)
    kernels.paged_attention(qkv, out, *index, k_cache, v_cache, heads, kv_heads, head_dim**-0.5, THREADS)
    assert_close(out, reference(qkv, k_cache, v_cache, index, heads, kv_heads, head_dim), torch.float32)


def test_paged_attention_threads_agree(kernels):
    """Each item (sequence, KV head, query tile) is one thread's: 1 and 2 threads give the same bits."""
    qkv, k_cache, v_cache, index = paged_batch([1, 70, 1, 5], [90, 80, 3, 40], 9, 3, 64, 16, torch.bfloat16, seed=5)
    outs = []
    for threads in (1, 2):
        out = torch.empty(qkv.shape[0], 9 * 64, dtype=torch.bfloat16)
        kernels.paged_attention(qkv, out, *index, k_cache, v_cache, 9, 3, 0.125, threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_paged_attention_some_sequences_only(kernels):
    """The backend leaves whole prompts to SDPA: the kernel gets the other sequences' rows only,
    attends exactly those, and leaves every other row as it was."""
    heads, kv_heads, head_dim = 9, 3, 64
    qkv, k_cache, v_cache, index = paged_batch([1, 12, 30, 1, 5], [40, 12, 30, 17, 25], heads, kv_heads, head_dim, 16, torch.float32, seed=9)
    expected = reference(qkv, k_cache, v_cache, index, heads, kv_heads, head_dim)
    chosen = torch.tensor([0, 3, 4])
    subset = tuple(t.index_select(0, chosen).contiguous() for t in index)
    out = torch.full((qkv.shape[0], heads * head_dim), 123.0)
    kernels.paged_attention(qkv, out, *subset, k_cache, v_cache, heads, kv_heads, head_dim**-0.5, THREADS)
    rows = torch.tensor([0, 43, 44, 45, 46, 47, 48])  # sequences 0, 3 and 4
    others = torch.tensor([r for r in range(qkv.shape[0]) if r not in rows.tolist()])
    assert_close(out[rows], expected[rows], torch.float32)
    assert (out[others] == 123.0).all()


# --------------------------------------------------------------------------- through the model
from tests.engine.kernel_levels import cpu_kernels_for_level  # noqa: E402
from tests.engine.test_cpu_kernels import TwoPaths, build_model, make_seqs, nan_filled_caches  # noqa: E402  (the fused-model harness)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def fused_model(request, kernels, tiny_checkpoint):
    return build_model(tiny_checkpoint, request.param, kernels), build_model(tiny_checkpoint, request.param, None)


def test_many_decodes_beside_prefill_chunks_match_torch(fused_model, monkeypatch):
    """Steps with at least two decodes per thread take paged_attention for the decodes (prefill
    chunks, with and without a cached prefix, stay with SDPA in the same step); logits, caches and
    greedy tokens match the torch path's, step after step."""
    calls = []
    kernels = fused_model[0].backend.kernels
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **k: calls.append(1) or type(kernels).paged_attention(kernels, *a, **k))
    # the route under test on every build (off AMX tiles the backend keeps decodes on paged_decode_attention),
    # prefill chunks with SDPA (where the kernel takes them too: the test below)
    monkeypatch.setattr(kernels, "paged_attention_takes_decodes", lambda *args: True)
    monkeypatch.setattr(kernels, "paged_attention_takes_chunks", lambda *args: False)
    # the per-op path under test: the compiled step (which calls the kernel from C, where the
    # counter cannot see it) would take the all-decode step; tests/engine/test_decode_step.py has it
    monkeypatch.setattr(fused_model[0], "decode_step", None)
    paths = TwoPaths(fused_model)
    vocab = fused_model[0].vocab_size
    short = make_seqs(vocab, [3, 5, 9, 12, 17, 2, 8, 6], seed=11)
    long = make_seqs(vocab, [40], seed=12)[0]
    long.seq_id = len(short)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # 8 decodes: two per thread and more
    paths.step(short, [s.num_tokens for s in short])  # prompts only: no kernel call
    assert not calls
    for _ in range(3):  # 8 decodes in rows 0..7, then the long prompt's chunk (behind a prefix from the 2nd)
        paths.step(short + [long], [1] * len(short) + [10])
    paths.step([long] + short, [10] + [1] * len(short))  # the decodes in rows 10..17
    assert long.num_computed_tokens == 40
    paths.step([long] + short, [1] * (len(short) + 1))  # every sequence decodes
    assert len(calls) == len(fused_model[0].layers) * 5


def test_prefill_chunks_through_paged_attention_match_torch(fused_model, monkeypatch):
    """Where paged_attention takes prefill chunks (AMX tiles; float32 on AVX2; forced here on every
    build, the vector path for both dtypes), a step with chunks runs every sequence in one call, SDPA
    unused: prompts alone, chunks behind a cached prefix with decodes beside them, then decodes only
    (paged_decode_attention); logits, caches and greedy tokens match the torch path's."""
    calls = []
    model = fused_model[0]
    kernels = model.backend.kernels
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **k: calls.append(1) or type(kernels).paged_attention(kernels, *a, **k))
    monkeypatch.setattr(kernels, "paged_attention_takes_chunks", lambda *args: True)
    monkeypatch.setattr(kernels, "paged_attention_takes_decodes", lambda *args: False)
    monkeypatch.setattr("engine.backends.cpu.prefill_attention", None)  # the fused path's SDPA: any call fails
    monkeypatch.setattr(model, "decode_step", None)  # the per-op path, whose calls the counter sees
    paths = TwoPaths(fused_model)
    vocab = model.vocab_size
    short = make_seqs(vocab, [3, 5, 20, 12], seed=15)
    long = make_seqs(vocab, [45], seed=16)[0]
    long.seq_id = len(short)
    paths.step(short, [s.num_tokens for s in short])  # prompts only
    assert len(calls) == len(model.layers)
    for _ in range(3):  # decodes beside the long prompt's chunks (behind a prefix from the 2nd)
        paths.step(short + [long], [1] * len(short) + [13])
    paths.step([long] + short, [6] + [1] * len(short))
    assert long.num_computed_tokens == 45 and len(calls) == len(model.layers) * 5
    paths.step([long] + short, [1] * (len(short) + 1))  # decodes only: paged_decode_attention
    assert len(calls) == len(model.layers) * 5


def test_native_build_takes_chunks_where_it_beats_sdpa(kernels):
    """This machine's build routes prefill chunks to paged_attention exactly where it was measured
    to beat SDPA: AVX builds (AVX2 and AVX-512 alike), float32 and bfloat16 (and on AMX tiles, bfloat16)."""
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    avx = "avx" in flags
    assert kernels.paged_attention_takes_chunks(torch.float32, 64, 16) == avx
    assert kernels.paged_attention_takes_chunks(torch.bfloat16, 64, 16) == (avx or on_tiles(kernels, 64, 16))
    assert not kernels.paged_attention_takes_chunks(torch.float32, 24, 16)  # head_dim not a multiple of 16


# --------------------------------------------------------------------------- each x86-64 level's build
# level: takes prefill chunks (decodes: paged_decode_attention's at every level, bfloat16 on AMX tiles
# aside); the routing follows the instruction set, not the lanes: the 16-lane v3 build routes as v3;
# x86-64-v4 on AVX-512 CPUs only
LEVELS = {"x86-64-v3": True, "x86-64-v2": False, "x86-64-v3-16-lanes": True, "x86-64-v4": True}


@pytest.fixture(scope="module", params=list(LEVELS))
def level_kernels(request, tmp_path_factory) -> tuple[str, ck.CpuKernels]:
    """The cpu_kernels library built for one x86-64 level (v3: the 8-lane AVX2 tile; v2: the 4-lane
    SSE one), as the image prebuilds them, or v3 with 16 lanes (the AVX-512 builds' pa_tile and
    16-keys-at-a-time decode scoring, their add tree generic); skipped where this CPU cannot run it."""
    return request.param, cpu_kernels_for_level(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (24, 1, 16), (6, 2, 48)], ids=str)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_paged_attention_at_each_level_matches_reference(level_kernels, dtype, heads, kv_heads, head_dim, batch):
    """The vector path in each level's lanes against float64 maths: head_dims of 2, 6, 8 and 16
    vectors of 8 lanes (more than the 8 a row's weighted values accumulate at once), 4 to 32 of 4."""
    _, lib = level_kernels
    new_tokens, kv_lens = BATCHES[batch]
    qkv, k_cache, v_cache, index = paged_batch(new_tokens, kv_lens, heads, kv_heads, head_dim, 16, dtype, seed=heads + head_dim)
    out = torch.full((qkv.shape[0], heads * head_dim), 123.0, dtype=dtype)
    lib.paged_attention(qkv, out, *index, k_cache, v_cache, heads, kv_heads, head_dim**-0.5, THREADS)
    assert_close(out, reference(qkv, k_cache, v_cache, index, heads, kv_heads, head_dim), dtype)


# decodes of 1 to 100 keys (each a task), and two decodes on 2 threads: the 300-key one split in
# block ranges, so a range's K/V stream (what the next block prefetches) starts mid-table
DECODE_BATCHES = {"decodes": BATCHES["decodes"], "split": ([1, 1], [300, 37])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (8, 1, 128), (24, 1, 16), (6, 2, 48)], ids=str)
@pytest.mark.parametrize("batch", list(DECODE_BATCHES))
@pytest.mark.parametrize("invariant", [False, True], ids=["batched", "invariant"])
def test_paged_decode_attention_at_each_level_matches_reference(level_kernels, dtype, heads, kv_heads, head_dim, batch, invariant):
    """paged_decode_attention (pure-decode steps off AMX tiles) in each level's build against
    float64 maths, rows of a slot's KV head of 1 to 8 cache lines shared over 1 to 24 query heads
    (the prefetch of the next block spread over them), NaN in every slot no sequence owns."""
    _, lib = level_kernels
    new_tokens, kv_lens = DECODE_BATCHES[batch]
    qkv, k_cache, v_cache, index = paged_batch(new_tokens, kv_lens, heads, kv_heads, head_dim, 16, dtype, seed=heads + head_dim)
    _, _, seq_lens, tables = index
    out = torch.full((qkv.shape[0], heads * head_dim), 123.0, dtype=dtype)
    rows = torch.arange(len(kv_lens), dtype=torch.int64)
    lib.paged_decode_attention(qkv, out, rows, k_cache, v_cache, tables, seq_lens, heads, kv_heads, head_dim**-0.5, THREADS, invariant=invariant)
    assert_close(out, reference(qkv, k_cache, v_cache, index, heads, kv_heads, head_dim), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8, 24, 48])
def test_each_level_over_block_sizes(level_kernels, dtype, block_size):
    """Blocks smaller than a level's lanes (1, 8: no whole run of NV_LANES keys in a block), not a
    multiple of them (24), and holding 3 runs of 16 (48), keys past a run's end in each: paged_attention
    (a prompt behind a prefix, decodes) and paged_decode_attention (batched and invariant) against
    float64 maths; in the invariant mode each sequence alone gives the bits it gives batched."""
    _, lib = level_kernels
    heads, kv_heads, head_dim = 6, 2, 64
    new_tokens, kv_lens = [1, 30, 1, 1], [50, 45, 7, 113]
    qkv, k_cache, v_cache, index = paged_batch(new_tokens, kv_lens, heads, kv_heads, head_dim, block_size, dtype, seed=block_size)
    expected = reference(qkv, k_cache, v_cache, index, heads, kv_heads, head_dim)
    out = torch.full((qkv.shape[0], heads * head_dim), 123.0, dtype=dtype)
    lib.paged_attention(qkv, out, *index, k_cache, v_cache, heads, kv_heads, head_dim**-0.5, THREADS)
    assert_close(out, expected, dtype)
    decodes = [0, 2, 3]  # sequences with one new token
    starts, _, seq_lens, tables = index
    rows, lens, tabs = starts[decodes].long(), seq_lens[decodes], tables[decodes]
    for invariant in (False, True):
        out = torch.full((qkv.shape[0], heads * head_dim), 123.0, dtype=dtype)
        lib.paged_decode_attention(qkv, out, rows, k_cache, v_cache, tabs, lens, heads, kv_heads, head_dim**-0.5, THREADS, invariant=invariant)
        assert_close(out[rows], expected[rows], dtype)
    for b in range(len(decodes)):
        alone = torch.full_like(out, 123.0)
        lib.paged_decode_attention(qkv, alone, rows[b : b + 1], k_cache, v_cache, tabs[b : b + 1], lens[b : b + 1], heads, kv_heads,
                                   head_dim**-0.5, THREADS, invariant=True)  # fmt: skip
        assert torch.equal(alone[rows[b]], out[rows[b]])


def test_each_level_routes_as_measured(level_kernels):
    level, lib = level_kernels
    takes_chunks, tiles = LEVELS[level], on_tiles(lib, 64, 16)
    assert lib.paged_attention_takes_chunks(torch.float32, 64, 16) == takes_chunks
    assert lib.paged_attention_takes_chunks(torch.bfloat16, 64, 16) == (takes_chunks or tiles)
    assert not lib.paged_attention_takes_decodes(torch.float32)
    assert lib.paged_attention_takes_decodes(torch.bfloat16) == tiles


# --------------------------------------------------------------------------- on AMX tiles (bfloat16)
def on_tiles(kernels: ck.CpuKernels, head_dim: int, block_size: int) -> bool:
    return kernels.paged_attention_on_tiles(torch.bfloat16, head_dim, block_size)


# query heads per KV head 16 (a tile's 16 columns, one token each), 5 (3 tokens of 15 rows), 2, and
# past a tile's columns: 20 (two groups of 10), 17 (17 groups of 1); prompts with and without a
# prefix, over several 16-key runs, odd lengths, decodes beside them
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(16, 1, 64), (10, 2, 64), (6, 3, 128), (40, 2, 64), (17, 1, 64)], ids=str
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_tiles_match_reference(kernels, heads, kv_heads, head_dim, block_size):
    if not on_tiles(kernels, head_dim, block_size):
        pytest.skip("no AMX tiles here: the vector path, which the other tests cover")
    new_tokens, kv_lens = [1, 70, 33, 1, 16, 1], [161, 120, 33, 16, 47, 2]
    qkv, k_cache, v_cache, index = paged_batch(new_tokens, kv_lens, heads, kv_heads, head_dim, block_size, torch.bfloat16, seed=heads)
    out = torch.full((qkv.shape[0], heads * head_dim), 123.0, dtype=torch.bfloat16)
    kernels.paged_attention(qkv, out, *index, k_cache, v_cache, heads, kv_heads, head_dim**-0.5, THREADS)
    assert_close(out, reference(qkv, k_cache, v_cache, index, heads, kv_heads, head_dim), torch.bfloat16)


def test_paged_attention_tiles_many_decodes(kernels):
    """A decode step's shape on tiles: more sequences than threads (each thread claims its next one
    mid-item and prefetches its first run), lengths of 1 key, run boundaries and one past them, a
    prompt chunk among them; equal to the reference, and 1 and 2 threads give the same bits."""
    if not on_tiles(kernels, 64, 16):
        pytest.skip("no AMX tiles here")
    kv_lens = [1, 16, 17, 32, 33, 160, 161, 2, 15, 48, 100, 200, 31, 64, 65, 7] * 2 + [40]
    new_tokens = [1] * (len(kv_lens) - 1) + [24]
    qkv, k_cache, v_cache, index = paged_batch(new_tokens, kv_lens, 9, 3, 64, 16, torch.bfloat16, seed=11)
    outs = []
    for threads in (1, 2):
        out = torch.full((qkv.shape[0], 9 * 64), 123.0, dtype=torch.bfloat16)
        kernels.paged_attention(qkv, out, *index, k_cache, v_cache, 9, 3, 0.125, threads)
        outs.append(out)
    assert_close(outs[1], reference(qkv, k_cache, v_cache, index, 9, 3, 64), torch.bfloat16)
    assert torch.equal(outs[0], outs[1])


def test_paged_attention_on_tiles_shapes(kernels):
    """Never for float32, head_dims other than multiples of 64, or blocks not a multiple of 16 keys."""
    assert not kernels.paged_attention_on_tiles(torch.float32, 64, 16)
    assert not kernels.paged_attention_on_tiles(torch.bfloat16, 32, 16)
    assert not kernels.paged_attention_on_tiles(torch.bfloat16, 64, 8)
    assert not kernels.paged_attention_on_tiles(torch.bfloat16, 64, 24)


def test_many_decodes_take_paged_attention_on_amx_tiles_only(kernels):
    """This machine's build (-march=native) routes a step's decodes to paged_attention for bfloat16
    caches on AMX tiles only; elsewhere (AVX2, AVX-512 without AMX, float32) paged_decode_attention
    keeps them, the faster there (engine/kernels/csrc/attention.c)."""
    assert not kernels.paged_attention_takes_decodes(torch.float32)
    assert kernels.paged_attention_takes_decodes(torch.bfloat16) == on_tiles(kernels, 64, 16)
    assert not kernels.paged_attention_takes_decodes(torch.float16)  # no such caches in the kernels


def test_the_plain_x86_64_v2_build_runs_attention_on_tiles(kernels, tmp_path):
    """The image's prebuilt libraries: the tile path carries its own target attributes (vec.h), so
    even the lowest level's build runs it where the CPU and Linux allow tiles, bit for bit as the
    build for this CPU does."""
    if not on_tiles(kernels, 64, 16):
        pytest.skip("no AMX tiles here")
    import ctypes

    try:
        (path,) = build.prebuild(tmp_path, ["x86-64-v2"], [build.CPU_KERNELS])
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no working C compiler here: {exc}")
    v2 = ck.CpuKernels(ctypes.CDLL(str(path)))
    assert v2.paged_attention_on_tiles(torch.bfloat16, 64, 16)
    qkv, k_cache, v_cache, index = paged_batch([1, 40, 1], [90, 40, 17], 6, 2, 64, 16, torch.bfloat16, seed=7)
    outs = []
    for lib in (kernels, v2):
        out = torch.empty(qkv.shape[0], 6 * 64, dtype=torch.bfloat16)
        lib.paged_attention(qkv, out, *index, k_cache, v_cache, 6, 2, 64**-0.5, THREADS)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.fixture(scope="module")
def head64_checkpoint(tmp_path_factory, tiny_model_args):
    """The tiny model with head_dim 64 (dim 256, 4 query / 2 KV heads): the shape the tiles take."""
    import dataclasses

    from engine.loading.checkpoint import write_random_checkpoint

    args = dataclasses.replace(tiny_model_args, dim=256)
    return write_random_checkpoint(tmp_path_factory.mktemp("head64"), args, num_shards=1, seed=0, dtype=torch.float32)


def test_prefill_chunks_on_tiles_match_torch(kernels, head64_checkpoint, monkeypatch):
    """Where the kernel runs on tiles, steps with prefill chunks (with and without a cached prefix,
    decodes beside them) go to it whole, SDPA unused; logits, caches and greedy tokens match the
    torch path's step after step."""
    if not on_tiles(kernels, 64, 16):
        pytest.skip("no AMX tiles here: prefill chunks stay with SDPA")
    models = build_model(head64_checkpoint, torch.bfloat16, kernels), build_model(head64_checkpoint, torch.bfloat16, None)
    calls = []
    monkeypatch.setattr(kernels, "paged_attention", lambda *a, **k: calls.append(1) or type(kernels).paged_attention(kernels, *a, **k))
    monkeypatch.setattr("engine.backends.cpu.prefill_attention", None)  # the fused path's SDPA: any call fails
    monkeypatch.setattr("tests.engine.test_cpu_kernels.BLOCK_SIZE", 16)  # the harness's 8 is not a tile's 16
    paths = TwoPaths(models)
    vocab = models[0].vocab_size
    short = make_seqs(vocab, [3, 5, 20, 12], seed=13)
    long = make_seqs(vocab, [60], seed=14)[0]
    long.seq_id = len(short)
    paths.step(short, [s.num_tokens for s in short])  # prompts only
    assert len(calls) == len(models[0].layers)
    for _ in range(3):  # decodes beside the long prompt's chunks (behind a prefix from the 2nd)
        paths.step(short + [long], [1] * len(short) + [17])
    paths.step([long] + short, [9] + [1] * len(short))
    assert long.num_computed_tokens == 60
    assert len(calls) == len(models[0].layers) * 5

