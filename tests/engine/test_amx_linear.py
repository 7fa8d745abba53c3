"""The AMX bfloat16 linear (engine/kernels/amx.py, engine/kernels/csrc/amx_linear.c) against torch: float32
matmul of the same bfloat16 inputs, rounded once; thread counts agree bit for bit; shapes it cannot
take are refused; PackedCpuLinear routes 2..AMX_MAX_ROWS bfloat16 rows through it on the pairs
copy (no further weight copy) and the rest through oneDNN / the one-row kernel.

Skipped (with the reason) where this CPU or OS has no AMX bfloat16 tiles or no compiler."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

from engine.kernels import amx as amx_mod
from engine.kernels import build
from engine.backends import cpu
from engine.backends.cpu import PackedCpuLinear, pack_weight
from engine.kernels.cpu import load_cpu_kernels

DEMO_SHAPES = [(960, 576), (3072, 576), (576, 576), (576, 1536)]  # [out, in]: qkv, w13, wo, w2


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    if k is None or not k.has_bf16_pairs:
        pytest.skip("no CPU kernels with the AVX512_BF16 pairs layout here")
    return k


@pytest.fixture(scope="module")
def amx():
    a = amx_mod.load_amx_linear()
    if a is None:
        pytest.skip("no AMX bfloat16 tiles on this CPU/OS (amx_init returned 0) or no compiler")
    return a


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.float() @ weight.float().T


def assert_close_to_reference(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Within one bfloat16 rounding of the float32 result plus float32 summation-order error."""
    ref = reference(x, weight)
    sum_scale = (x.float().abs() @ weight.float().abs().T)  # bounds the float32 rounding of any order
    tol = ref.abs() * 2**-8 + sum_scale * 2**-20
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert ((out.float() - ref).abs() <= tol).all(), (out.float() - ref).abs().max()


@pytest.mark.parametrize("n,k", DEMO_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65])
def test_matches_float32_matmul(kernels, amx, n, k, rows):
    torch.manual_seed(rows * 7 + n + k)
    weight, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    out = amx.linear(x, kernels.interleave(weight), 2)
    assert_close_to_reference(out, x, weight)


def test_large_row_counts_and_odd_column_blocks(kernels, amx):
    """More rows than one 32-row pass, and n an odd number of 16-column blocks (a last lone block)."""
    torch.manual_seed(1)
    weight, x = torch.randn(48, 64).bfloat16(), torch.randn(130, 64).bfloat16()
    assert_close_to_reference(amx.linear(x, kernels.interleave(weight), 2), x, weight)


# [out, in] shapes and row counts that take the blocked loop for prefill chunks (amx_linear.c
# many_rows: x over 1 MB, k at most 8192): k 2048 from 257 rows, k 576 from 911, k 8192 from 65;
# with odd row counts (a partial last row block: the padded tail copy), an odd number of row blocks
# (a lone last one), more rows than one L2 block of x (1 MB: 256 rows of k 2048, 64 of k 8192) and
# n an odd number of 16-column blocks (a last lone column block).
BLOCKED_CASES = [
    (96, 2048, 257),
    (48, 2048, 513),
    (80, 2048, 1024),
    (64, 2048, 200),
    (3072, 576, 1000),
    (576, 1536, 700),
    (48, 8192, 130),
    (80, 5632, 203),
]


@pytest.mark.parametrize("n,k,rows", BLOCKED_CASES)
def test_prefill_sizes_match_float32_matmul(kernels, amx, n, k, rows):
    torch.manual_seed(rows + n)
    weight, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    assert_close_to_reference(amx.linear(x, kernels.interleave(weight), 2), x, weight)


@pytest.mark.parametrize("n,k,rows", BLOCKED_CASES)
def test_the_loop_chosen_does_not_change_a_row(kernels, amx, n, k, rows):
    """Each output is the same float32 sum over k whichever loop computes it (the blocked one keeps
    its partial sums exactly between k chunks): a row's result is the same bits in a prefill-sized
    call as in a decode-sized one, and at 1 thread as at 2."""
    torch.manual_seed(rows * 3 + k)
    weight, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    pairs = kernels.interleave(weight)
    big = amx.linear(x, pairs, 2)
    assert torch.equal(big, amx.linear(x, pairs, 1))
    for start in (0, rows - 37, rows // 2):
        assert torch.equal(big[start : start + 37], amx.linear(x[start : start + 37].contiguous(), pairs, 2))


def test_prefill_sizes_exact_on_integers(kernels, amx):
    """Small integers, k split into chunks: every float32 sum is exact, so partial sums carried
    across chunks lose nothing and the result is the exact sum rounded once to bfloat16."""
    torch.manual_seed(7)
    weight = torch.randint(-3, 4, (64, 2048)).bfloat16()
    x = torch.randint(-3, 4, (301, 2048)).bfloat16()
    assert torch.equal(amx.linear(x, kernels.interleave(weight), 2), reference(x, weight).bfloat16())


@pytest.mark.parametrize("rows", [2, 17, 64])
def test_thread_counts_agree_bit_for_bit(kernels, amx, rows):
    torch.manual_seed(rows)
    weight, x = torch.randn(3072, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
    pairs = kernels.interleave(weight)
    assert torch.equal(amx.linear(x, pairs, 1), amx.linear(x, pairs, 2))


def test_exact_on_integers(kernels, amx):
    """Small integers: every product and sum is exact in float32 and bfloat16 alike."""
    torch.manual_seed(2)
    weight = torch.randint(-3, 4, (64, 96)).bfloat16()
    x = torch.randint(-3, 4, (5, 96)).bfloat16()
    assert torch.equal(amx.linear(x, kernels.interleave(weight), 2).float(), reference(x, weight))


def test_k_not_a_multiple_of_32_is_refused(kernels, amx):
    """The kernel has no partial k tile: such weights are refused at bind (and the C entry point
    refuses the shape itself before touching memory)."""
    pairs = kernels.interleave(torch.randn(32, 48).bfloat16())
    assert not amx.supports(pairs)
    with pytest.raises(ValueError):
        amx.bind(pairs)
    lib = ctypes.CDLL(str(build.library_path(build.AMX_LINEAR)))
    x, out = torch.randn(2, 48).bfloat16(), torch.empty(2, 32, dtype=torch.bfloat16)
    rc = lib.amx_linear_bf16(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(pairs.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                             ctypes.c_int64(2), ctypes.c_int64(32), ctypes.c_int64(48), ctypes.c_int(1))  # fmt: skip
    assert rc == -1


def test_packed_linear_routes_batches_through_amx(kernels, amx, monkeypatch):
    """2..AMX_MAX_ROWS bfloat16 rows through the tiles, the rest through oneDNN; the pairs copy is
    the only extra copy (resident_bytes unchanged by AMX)."""
    torch.manual_seed(3)
    weight = torch.randn(960, 576).bfloat16()
    packed = pack_weight(weight, kernels)
    with_amx, without = PackedCpuLinear(packed, kernels, amx), PackedCpuLinear(packed, kernels)
    assert with_amx.resident_bytes() == without.resident_bytes()
    calls = []
    real_bind = amx.bind

    def counting_bind(pairs):
        fn = real_bind(pairs)
        return lambda x, threads: calls.append(x.shape[0]) or fn(x, threads)

    monkeypatch.setattr(amx, "bind", counting_bind)
    layer = PackedCpuLinear(packed, kernels, amx)
    for rows in (1, 2, 33, cpu.AMX_MAX_ROWS, cpu.AMX_MAX_ROWS + 1, 200):
        x = torch.randn(rows, 576).bfloat16()
        assert_close_to_reference(layer(x), x, weight)
    assert calls == [2, 33, cpu.AMX_MAX_ROWS]


def test_narrow_weights_take_the_tiles_at_every_row_count(kernels, amx, monkeypatch):
    """A weight with no more outputs than inputs (wo, w2) runs prefill-sized inputs on the tiles
    too, where oneDNN's packed kernel splits its few output columns poorly; one row stays on the
    one-row kernel."""
    torch.manual_seed(4)
    weight = torch.randn(64, 96).bfloat16()
    calls = []
    real_bind = amx.bind
    monkeypatch.setattr(amx, "bind", lambda pairs: (lambda fn: lambda x, threads: calls.append(x.shape[0]) or fn(x, threads))(real_bind(pairs)))
    layer = PackedCpuLinear(pack_weight(weight, kernels), kernels, amx)
    for rows in (1, 2, cpu.AMX_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 96).bfloat16()
        assert_close_to_reference(layer(x), x, weight)
    assert calls == [2, cpu.AMX_MAX_ROWS + 1, 300]


def test_float32_layers_never_take_amx(kernels, amx):
    packed = pack_weight(torch.randn(64, 64), kernels)
    assert PackedCpuLinear(packed, kernels, amx)._many_rows is None


def test_the_plain_x86_64_v2_build_runs_the_tiles(kernels, amx, tmp_path):
    """The image's prebuilt libraries: amx_linear.c carries its own target attributes, so even the
    lowest level's build runs AMX where amx_init allows it."""
    try:
        (path,) = build.prebuild(tmp_path, ["x86-64-v2"], [build.AMX_LINEAR])
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"no working C compiler here: {exc}")
    lib = ctypes.CDLL(str(path))
    assert lib.amx_init() == 1
    v2 = amx_mod.AmxLinear(lib)
    torch.manual_seed(4)
    weight, x = torch.randn(96, 64).bfloat16(), torch.randn(19, 64).bfloat16()
    pairs = kernels.interleave(weight)
    assert torch.equal(v2.linear(x, pairs, 2), amx.linear(x, pairs, 2))


def test_the_bfloat16_kernel_backend_packs_for_amx(kernels, amx):
    """CpuKernelBackend at bfloat16 hands its packed linears the AMX kernel (so the fused-model tests
    in test_cpu_kernels.py run their 2..64-row steps through it); at float32 it does not."""
    from engine.backends.cpu import CpuKernelBackend

    bf16 = CpuKernelBackend(torch.device("cpu"), torch.bfloat16, kernels)
    layer = bf16.special_linear(bf16.prepare_linear(torch.randn(96, 64).bfloat16()))
    assert isinstance(layer, PackedCpuLinear) and layer._many_rows is not None
    assert CpuKernelBackend(torch.device("cpu"), torch.float32, kernels).amx is None


def test_a_large_weight_keeps_the_pairs_copy_only(kernels, amx, monkeypatch):
    """Past INTERLEAVED_MAX_WEIGHT_BYTES a bfloat16 weight the tiles take gets the pairs copy in
    place of oneDNN's: one row through the one-row kernel, every other row count (prefill chunks
    included) through the tiles; for k the tiles refuse it stays on oneDNN, and without AMX it gets
    the pairs copy alone where the build has the pairs gemm. Such a weight handed no tiles runs its
    2+ rows on the pairs gemm (AVX512_BF16 builds), every row count."""
    monkeypatch.setattr(cpu, "INTERLEAVED_MAX_WEIGHT_BYTES", 64 * 96 * 2 - 1)  # a small weight counts as large
    torch.manual_seed(5)
    weight = torch.randn(64, 96).bfloat16()
    packed = pack_weight(weight, kernels, amx)
    assert packed.packed is None and packed.interleaved is not None
    layer = PackedCpuLinear(packed, kernels, amx)
    assert layer.resident_bytes() == weight.numel() * 2
    for rows in (1, 2, cpu.AMX_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 96).bfloat16()
        assert_close_to_reference(layer(x), x, weight)
    alone = pack_weight(weight, kernels)  # no tiles: the pairs gemm's build (AVX512_BF16) takes it alone too
    assert (alone.packed is None, alone.interleaved is not None) == (kernels.has_pairs_gemm, kernels.has_pairs_gemm)
    assert pack_weight(torch.randn(64, 48).bfloat16(), kernels, amx).packed is not None  # k % 32: oneDNN
    without_tiles = PackedCpuLinear(packed, kernels)
    assert without_tiles.pairs_rows() == cpu.AMX_MAX_ROWS and not without_tiles.pairs_on_tiles()
    for rows in (2, 300):
        x = torch.randn(rows, 96).bfloat16()
        assert_close_to_reference(without_tiles(x), x, weight)


def test_moving_the_copy_moves_the_tiles_too(kernels, amx):
    """move_one_row_copy (the decode step's huge-page arena) rebinds the AMX call as well: the old
    copy is not read, nor kept alive, by either path."""
    torch.manual_seed(6)
    weight = torch.randn(96, 64).bfloat16()
    layer = PackedCpuLinear(pack_weight(weight, kernels), kernels, amx)
    moved = layer.interleaved.clone()
    layer.move_one_row_copy(moved)
    assert layer._many_rows.weight is moved and layer._one_row.weight is moved
    x = torch.randn(5, 64).bfloat16()
    assert_close_to_reference(layer(x), x, weight)


@pytest.mark.parametrize("n,k,rows", [(96, 576, 1), (3072, 576, 17), (80, 2048, 64), (3072, 576, 1000), (48, 2048, 257)])
def test_float32_out_is_the_tiles_sums_unrounded(kernels, amx, n, k, rows):
    """amx_linear_bf16_f32_out: the same float32 sums the bfloat16 kernel rounds (decode loop and
    blocked loop alike), within float32 summation-order error of float64, and each row's bits the
    same whatever rows share its call (the output head's logits then do not depend on the batch)."""
    torch.manual_seed(n + k + rows)
    weight, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    pairs = kernels.interleave(weight)
    out = amx.bind(pairs, f32_out=True)(x, 2)
    exact = x.double() @ weight.double().T
    assert out.dtype == torch.float32 and ((out.double() - exact).abs() <= (x.double().abs() @ weight.double().abs().T) * 2**-20).all()
    assert torch.equal(out.bfloat16(), amx.linear(x, pairs, 2))
    for start in {0, rows // 2, rows - 1}:
        assert torch.equal(out[start], amx.bind(pairs, f32_out=True)(x[start : start + 1].contiguous(), 1)[0])


def test_the_float32_head_runs_on_the_tiles(kernels, amx):
    """A bfloat16 model's output head on AMX CPUs: float32 logits from the tiles at every row count
    (no longer the one-row kernel's rows, 6x slower at 32), the same bits for a row alone as batched;
    the batch-invariant backend's head is the same."""
    from engine.backends.cpu import CpuKernelBackend, InterleavedHeadLinear

    torch.manual_seed(8)
    weight, x = torch.randn(160, 64).bfloat16(), torch.randn(33, 64).bfloat16()
    backend = CpuKernelBackend(torch.device("cpu"), torch.bfloat16, kernels)
    head = backend.head_linear(backend.prepare_head(weight))
    assert isinstance(head, InterleavedHeadLinear) and head._amx is not None
    logits = head(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, amx.bind(head.interleaved, f32_out=True)(x, 2))
    assert torch.equal(head(x[5:6].contiguous())[0], logits[5])
    # a step whose rows sample nothing (a long prompt's chunks before its last) hands the head no row
    assert head(x[:0]).shape == (0, 160) and amx.linear(x[:0], head.interleaved, 2).shape == (0, 160)
    moved = head.interleaved.clone()
    head.move_one_row_copy(moved)
    assert head._amx.weight is moved and torch.equal(head(x), logits)
    invariant = CpuKernelBackend(torch.device("cpu"), torch.bfloat16, kernels, batch_invariant=True)
    invariant_head = invariant.head_linear(invariant.prepare_head(weight))
    assert invariant_head._amx is not None and torch.equal(invariant_head(x), logits)


@pytest.mark.parametrize("cap,tiles", [("AVX512_CORE_BF16", False), ("avx2", False), ("AVX512_CORE_AMX", True), ("ALL", True)])
def test_onednn_max_cpu_isa_caps_the_tiles_too(kernels, amx, cap, tiles):
    """ONEDNN_MAX_CPU_ISA below AMX keeps every kernel of ours off the tiles, as it keeps oneDNN's
    (a process then runs as on a CPU without them: the linears and the paged attention alike)."""
    import os
    import sys

    code = ("import torch; from engine.kernels.amx import load_amx_linear; from engine.kernels.cpu import load_cpu_kernels; "
            "print(load_amx_linear() is not None, load_cpu_kernels().paged_attention_on_tiles(torch.bfloat16, 64, 16))")  # fmt: skip
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == [str(tiles), str(tiles)]
