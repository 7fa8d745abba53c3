"""engine/kernels/memory.py: the row buckets of packed oneDNN linears (a handful of primitives serve every
step size) and the heap trim a CPU engine runs once idle. Resident memory itself is measured by
bench/step_memory.py and bench/soak.py, not here."""

from __future__ import annotations

import asyncio
import ctypes.util
import sys
import threading

import pytest
import torch

import engine.core.async_engine
import engine.backends.cpu as cpu
from engine.backends.cpu import PackedCpuLinear, pack_weight, packing_available
from engine.kernels.memory import ARENA_ALIGN_BYTES, HUGE_PAGE_BYTES, EXACT_ROWS, WeightArena, idle_heap_trim, onednn_rows
from tests.engine.test_async_engine import collect, make_engine, request, wait_until


def test_rows_up_to_exact_rows_run_as_they_are():
    assert [onednn_rows(rows) for rows in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))


def test_buckets_cover_every_step_size_with_a_few_sizes():
    padded = {rows: onednn_rows(rows) for rows in range(1, 4097)}
    assert all(p >= rows for rows, p in padded.items())
    assert all(p < rows * 9 / 8 for rows, p in padded.items())  # less than 1/8 more rows
    assert all(p % 16 == 0 for rows, p in padded.items() if rows > 128)
    assert all(onednn_rows(p) == p for p in padded.values())  # a bucket is its own bucket
    assert all(padded[rows] <= padded[rows + 1] for rows in range(1, 4096))
    assert len({padded[rows] for rows in range(1, 513)}) == 56  # the default step budget: 56 sizes, not 512
    assert padded[17] == 18 and padded[33] == 36 and padded[129] == 144 and padded[257] == 288 and padded[512] == 512


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 17, 33, 100, 129, 300])
def test_padded_linear_matches_the_exact_call(monkeypatch, dtype, rows):
    if not packing_available(dtype):
        pytest.skip(f"oneDNN cannot run {dtype} here")
    torch.manual_seed(rows)
    weight = torch.randn(96, 64, dtype=dtype)
    layer = PackedCpuLinear(pack_weight(weight))
    x = torch.randn(rows, 64, dtype=dtype)
    with torch.inference_mode():
        padded = layer(x)
        monkeypatch.setattr(cpu, "onednn_rows", lambda rows: rows)
        exact = layer(x)
    assert padded.shape == (rows, 96) and padded.is_contiguous()
    # the call really ran at the bucket's size: the output is a view of its first rows
    assert padded.untyped_storage().nbytes() == onednn_rows(rows) * 96 * padded.element_size()
    # row for row the same dot products; oneDNN may pick another kernel for another row count
    torch.testing.assert_close(padded, exact)
    torch.testing.assert_close(padded.double(), x.double() @ weight.double().T, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=0.5 if dtype == torch.bfloat16 else 1e-4)


def test_inputs_with_more_than_two_dimensions_are_not_padded():
    if not packing_available(torch.float32):
        pytest.skip("no oneDNN")
    weight = torch.randn(32, 16)
    x = torch.randn(3, 17, 16)
    with torch.inference_mode():
        y = PackedCpuLinear(pack_weight(weight))(x)
    assert y.shape == (3, 17, 32)
    torch.testing.assert_close(y, x @ weight.T)


def test_heap_trim_is_for_cpu_engines_on_glibc():
    assert idle_heap_trim("cuda") is None
    if not sys.platform.startswith("linux") or "libc.so.6" not in (ctypes.util.find_library("c") or ""):
        pytest.skip("not glibc")
    trim = idle_heap_trim("cpu")
    assert trim is not None and trim() in (0, 1)  # malloc_trim: 1 when it returned memory


class TrimRecorder:
    def __init__(self) -> None:
        self.calls = 0
        self.called = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        self.called.set()


@pytest.fixture
def recorder(monkeypatch) -> TrimRecorder:
    trim = TrimRecorder()
    monkeypatch.setattr(engine.core.async_engine, "idle_heap_trim", lambda device: trim if device == "cpu" else None)
    monkeypatch.setattr(engine.core.async_engine, "IDLE_TRIM_AFTER_S", 0.01)
    return trim


async def test_an_idle_engine_trims_the_heap_once_after_steps(recorder: TrimRecorder):
    eng = make_engine()
    try:
        await asyncio.sleep(0.05)
        assert recorder.calls == 0  # no step has run: nothing to give back
        outs = await collect(eng, request("a", "abc"))
        assert outs[-1].finished
        assert await asyncio.to_thread(recorder.called.wait, 10.0)
        await asyncio.sleep(0.05)
        assert recorder.calls == 1  # once per idle spell, not every timeout
        recorder.called.clear()
        await collect(eng, request("b", "abcd"))
        assert await asyncio.to_thread(recorder.called.wait, 10.0)
        await wait_until(lambda: recorder.calls == 2)
    finally:
        await eng.shutdown()


async def test_cuda_engines_never_trim(recorder: TrimRecorder):
    eng = make_engine(device="cuda")
    try:
        await collect(eng, request("a", "abc"))
        await asyncio.sleep(0.05)
        assert eng._heap_trim is None and recorder.calls == 0
    finally:
        await eng.shutdown()


def thp_enabled() -> bool:
    """Transparent huge pages on in some mode (always / madvise): madvise(MADV_HUGEPAGE) succeeds."""
    try:
        return "[never]" not in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


def test_weight_arena_holds_equal_copies_back_to_back_on_cache_lines():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen).to(dtype) for shape, dtype in (((3, 5), torch.float32), ((7,), torch.bfloat16), ((4, 16, 2), torch.bfloat16), ((1,), torch.float32))]
    arena = WeightArena([(t.shape, t.dtype) for t in tensors])
    copies = [arena.place(i, t) for i, t in enumerate(tensors)]
    assert arena.buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert [c.data_ptr() - arena.buffer.data_ptr() for c in copies] == arena.offsets == [0, 64, 128, 384]
    for original, copy in zip(tensors, copies):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)
        assert copy.data_ptr() % ARENA_ALIGN_BYTES == 0 and copy.untyped_storage().data_ptr() == copies[0].untyped_storage().data_ptr()
    assert arena.nbytes == 384 + 4
    assert arena.huge_pages == thp_enabled()
    with pytest.raises(ValueError, match="slot 1"):
        arena.place(1, tensors[0])


def test_an_empty_weight_arena():
    arena = WeightArena([])
    assert arena.nbytes == 0 and not arena.huge_pages


def test_cpu_kv_caches_are_zeroed_disjoint_slots_of_one_huge_page_buffer():
    """allocate_kv_caches on the CPU: every layer's K and V zeroed, of the cache's shape, back to back
    in one huge-page arena (the kernels' scattered block reads), none overlapping another."""
    from engine.models.args import ModelArgs
    from engine.models.llama import allocate_kv_caches, kv_cache_shape

    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=32)
    caches = allocate_kv_caches(args, 1, 5, 16, dtype=torch.bfloat16, device=torch.device("cpu"))
    flat = [cache for layer in caches for cache in layer]
    assert len(caches) == 3 and all(c.shape == kv_cache_shape(args, 1, 5, 16) and c.dtype == torch.bfloat16 for c in flat)
    assert all(c.is_contiguous() and not c.any() for c in flat)
    assert len({c.untyped_storage().data_ptr() for c in flat}) == 1  # one buffer
    assert flat[0].data_ptr() % HUGE_PAGE_BYTES == 0
    for i, cache in enumerate(flat):  # each slot written alone: no other changes
        cache.fill_(i + 1)
    assert [c.unique().tolist() for c in flat] == [[i + 1] for i in range(6)]
