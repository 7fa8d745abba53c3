"""engine/memory.py: the row buckets of packed oneDNN linears (a handful of primitives serve every
step size) and the process's allocator settings. Resident memory itself is measured by
bench/step_memory.py and bench/soak.py, not here."""

from __future__ import annotations

import pytest
import torch

import engine.backends.cpu as cpu
from engine.backends.cpu import PackedCpuLinear, pack_weight, packing_available
from engine.memory import EXACT_ROWS, onednn_rows


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
