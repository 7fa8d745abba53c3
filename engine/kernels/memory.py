"""CPU resident memory: why a serving process plateaus early and then stays flat.

Under mixed prompt lengths with chunked prefill a step carries any token count from 1 to the step
budget. oneDNN creates, and caches (up to ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1024 by default), a
primitive with its own buffers for every distinct row count M of a packed linear, and glibc keeps
the memory its scratch buffers were freed into: a 2,000-request soak's resident memory grew 12.8%
after its first 200 requests, still meeting new M values (bench/NOTES.md, "Soak").

onednn_rows() pads a packed linear's rows up to a few buckets, so a handful of primitives per
weight shape serve every step: they are all created early, and memory stops growing once they are.
Rows at most 16 (small decode batches) run as they are; above that there are 8 buckets per doubling
of the row count, so padding adds less than 1/8 of the rows: on a CPU the multiply is already
compute-bound at a few dozen f32 rows, so coarser buckets (multiples of 16, say) would cost a
decode batch of 17 up to 88% more linear time. Up to 512 rows that is 56 sizes instead of 512,
about 0.5 MiB of oneDNN state each per weight shape (bench/step_memory.py measures memory and speed).

idle_heap_trim() gives a CPU engine glibc's malloc_trim(0), which the engine thread calls once it
has been idle for IDLE_TRIM_AFTER_S: glibc keeps the pages of freed activations and scratch
buffers in its arenas for reuse, so after a burst of long prompts the process would hold its peak
for good. Measured, not assumed: glibc allocator settings at start-up (a fixed M_MMAP_THRESHOLD,
trims while busy) cost steps their speed, and a smaller oneDNN primitive cache alone only slowed
the growth (torch's ideep glue keeps its own, LRU_CACHE_CAPACITY); bounding both caches instead of
padding is the measured alternative (bench/NOTES.md, "Soak").

WeightArena puts weights that a step streams in full (the one-row copies a batch-1 decode reads)
into one buffer on 2 MiB transparent huge pages, in the order they are read: on 4 KiB pages each
4 KiB is a TLB miss, and the demo's one-row copies streamed at 23-25 GB/s from separate
allocations against 25-27 GB/s from one huge-page buffer. Huge pages are asked for here, for
long-lived buffers only, not process-wide through torch's THP_MEM_ALLOC_ENABLE: that makes every
allocation of 2 MiB or more a fresh 2 MiB-aligned mapping, faulted in and zeroed again each step
(a 64-decode step's logits alone), which cost a 64-decode demo step 38 -> 49 ms (bench/NOTES.md,
"Huge pages").
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Callable

import torch

# Row counts up to this run at their own size: few, and seen early (decode batches).
EXACT_ROWS = 16
# Buckets per doubling of the row count: padding stays under 1/8 of the rows.
BUCKETS_PER_OCTAVE = 8


def onednn_rows(rows: int) -> int:
    """The row count a packed oneDNN linear runs at for `rows` input rows (>= rows): rows itself up
    to EXACT_ROWS, then the next multiple of 2^k / 8 for rows in (2^k, 2^(k+1)]: 18, 20, ..., 32,
    36, ..., 64, 72, ..., 128, 144, ..., 256, 288, ..., 512."""
    if rows <= EXACT_ROWS:
        return rows
    octave_start = 1 << ((rows - 1).bit_length() - 1)  # the power of two just below rows
    step = octave_start // BUCKETS_PER_OCTAVE
    return -(-rows // step) * step


# Idle this long before the heap is trimmed: a client that sends requests one after another does
# not pay for its pages coming back (page faults) on every request.
IDLE_TRIM_AFTER_S = 2.0


def idle_heap_trim(device: str) -> Callable[[], object] | None:
    """malloc_trim(0) for an engine on `device`: None on CUDA (steps allocate on the GPU, the host
    heap stays small) and where the C library is not glibc."""
    if device != "cpu":
        return None
    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return None
    return functools.partial(malloc_trim, 0)


HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
# each tensor of an arena starts on a cache line (the kernels' 64-byte vector loads)
ARENA_ALIGN_BYTES = 64


def _advise_huge_pages(address: int, nbytes: int) -> bool:
    """madvise(MADV_HUGEPAGE) on a 2 MiB-aligned range; False where the C library or the kernel
    has none (the range then stays on normal pages: slower, not wrong)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), MADV_HUGEPAGE) == 0


class WeightArena:
    """One buffer for tensors of the given (shape, dtype)s back to back (each on a cache line),
    advised onto huge pages before its first touch; place(i, t) copies t into slot i. The buffer
    lives as long as any tensor placed in it."""

    def __init__(self, specs: Sequence[tuple[torch.Size, torch.dtype]]) -> None:
        self.specs = list(specs)
        self.offsets, end = [], 0
        for shape, dtype in self.specs:
            start = -(-end // ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES
            self.offsets.append(start)
            end = start + shape.numel() * dtype.itemsize
        self.nbytes = end
        advised = -(-end // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # whole huge pages
        raw = torch.empty(advised + HUGE_PAGE_BYTES, dtype=torch.uint8)  # untouched until placed
        skip = -raw.data_ptr() % HUGE_PAGE_BYTES
        self.buffer = raw[skip : skip + end]
        self.huge_pages = end > 0 and _advise_huge_pages(raw.data_ptr() + skip, advised)

    def slot(self, i: int) -> torch.Tensor:
        """Slot i as a tensor of its shape and dtype (its bytes as they are: untouched until written)."""
        shape, dtype = self.specs[i]
        start = self.offsets[i]
        return self.buffer[start : start + shape.numel() * dtype.itemsize].view(dtype).view(shape)

    def place(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """Slot i holding a copy of t (of slot i's shape and dtype)."""
        shape, dtype = self.specs[i]
        if t.shape != shape or t.dtype != dtype:
            raise ValueError(f"slot {i} holds {dtype} {tuple(shape)}, not {t.dtype} {tuple(t.shape)}")
        return self.slot(i).copy_(t)


def huge_page_zeros(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed tensors of these shapes, back to back in one WeightArena (advised onto huge pages
    before the zeroing first touches them). For the paged KV caches: the attention kernels read a
    step's blocks scattered over each layer's cache, and on 4 KiB pages nearly every block costs a
    TLB miss and a page walk the prefetches cannot hide (32 decodes x 160 keys, 30 layers' caches,
    one thread: paged_decode_attention 1.28x, paged_attention 1.17x faster on huge pages;
    bench/NOTES.md 'Decode attention over a KV head's query rows')."""
    arena = WeightArena([(torch.Size(shape), dtype) for shape in shapes])
    return [arena.slot(i).zero_() for i in range(len(shapes))]
