"""Issue 29 (10): a C kernel whose allocation fails reports it (MemoryError through its binding) instead of
using the NULL and taking the server down; the engine fails that step's requests and keeps serving.

Allocations are made to fail deterministically through each library's test hook
(llamaserve_fail_allocs_after, csrc/vec.h): the next n succeed, every later one fails, until reset.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.kernels.amx import load_amx_linear
from engine.kernels.quant import load_quant_kernels
from engine.quant.formats import quantize_int8
from tests.engine.test_cpu_kernels import THREADS, gen, kernels, three_sequences  # noqa: F401 - kernels: a fixture


@pytest.fixture
def failing(kernels):
    """kernels.fail_allocs_after, always reset after the test (the hook is process-wide)."""
    yield kernels.fail_allocs_after
    kernels.fail_allocs_after(-1)


def assert_fails_then_recovers(call: Callable[[], torch.Tensor], fail_allocs_after: Callable[[int], None],
                               allocs_before_failure: int, what: str) -> None:
    """call() raises MemoryError naming `what` once allocations fail after the given count, and gives
    the same bits as before once they succeed again."""
    expected = call()
    fail_allocs_after(allocs_before_failure)
    try:
        with pytest.raises(MemoryError, match=what):
            call()
    finally:
        fail_allocs_after(-1)
    assert torch.equal(call(), expected)


def paged_attention_call(kernels, dtype: torch.dtype, new_tokens: list[int]) -> Callable[[], torch.Tensor]:
    """paged_attention over three_sequences, each with `new_tokens` rows in one qkv."""
    qkv, k_cache, v_cache, tables, seq_lens, heads, kv_heads, _ = three_sequences(dtype)
    counts = torch.tensor(new_tokens, dtype=torch.int32)
    row_start = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    qkv = qkv.repeat(-(-sum(new_tokens) // 3), 1)[: sum(new_tokens)].contiguous()

    def attend() -> torch.Tensor:
        out = torch.zeros(sum(new_tokens), heads * 64, dtype=dtype)
        kernels.paged_attention(qkv, out, row_start, counts, seq_lens, tables, k_cache, v_cache, heads, kv_heads,
                                0.125, THREADS)
        return out

    return attend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_linear_reports_a_failed_allocation(kernels, failing, dtype):
    g = gen(1)
    x, weight = torch.randn(3, 64, generator=g).to(dtype), kernels.interleave(torch.randn(32, 64, generator=g).to(dtype))
    if weight.dim() == 4:
        pytest.skip("a bfloat16 pairs copy (AVX512_BF16 builds): its kernel allocates nothing that could fail")
    assert_fails_then_recovers(lambda: kernels.interleaved_linear(x, weight, THREADS), failing, 0, "interleaved linear")


@pytest.mark.parametrize("allocs_before_failure", [0, 1, 2, 3])  # task table, partial results, then each task's scores
def test_paged_decode_attention_reports_each_failed_allocation(kernels, failing, allocs_before_failure):
    qkv, k_cache, v_cache, tables, seq_lens, heads, kv_heads, _ = three_sequences(torch.float32)
    rows = torch.arange(3, dtype=torch.int64)

    def attend() -> torch.Tensor:
        out = torch.empty(3, heads * 64)
        kernels.paged_decode_attention(qkv, out, rows, k_cache, v_cache, tables, seq_lens, heads, kv_heads, 0.125, THREADS)
        return out

    assert_fails_then_recovers(attend, failing, allocs_before_failure, "paged decode attention")


def test_paged_attention_reports_a_failed_allocation(kernels, failing):
    assert_fails_then_recovers(paged_attention_call(kernels, torch.float32, [2, 1, 3]), failing, 0, "paged attention")


@pytest.mark.parametrize("allocs_before_failure", [0, 1])  # the item table, then each item's scratch
def test_paged_attention_on_amx_tiles_reports_a_failed_allocation(kernels, failing, allocs_before_failure):
    if not kernels.paged_attention_on_tiles(torch.bfloat16, 64, 16):
        pytest.skip("no AMX tiles on this CPU: the tile path cannot run here")
    attend = paged_attention_call(kernels, torch.bfloat16, [1, 1, 1])
    assert_fails_then_recovers(attend, failing, allocs_before_failure, "paged attention")


def test_amx_linear_reports_a_failed_allocation(kernels):
    amx = load_amx_linear()
    if amx is None:
        pytest.skip("no AMX tiles on this CPU: the AMX linear cannot run here")
    g = gen(4)
    linear = amx.bind(kernels.interleave(torch.randn(32, 64, generator=g).bfloat16()))
    x = torch.randn(3, 64, generator=g).bfloat16()  # 3 rows: the zero-padded copy to a whole tile
    assert_fails_then_recovers(lambda: linear(x, THREADS), amx.fail_allocs_after, 0, "amx_linear_bf16")


def test_the_hook_is_inert_by_default_and_counts_allocations(kernels, failing):
    """Two one-row linears allocate one input copy each: with one allocation allowed, the second fails."""
    g = gen(2)
    x, weight = torch.randn(1, 32, generator=g), kernels.interleave(torch.randn(16, 32, generator=g))
    for _ in range(3):
        kernels.interleaved_linear(x, weight, THREADS)  # nothing armed: every call allocates freely
    failing(1)
    kernels.interleaved_linear(x, weight, THREADS)
    with pytest.raises(MemoryError):
        kernels.interleaved_linear(x, weight, THREADS)


def test_quantized_linear_reports_a_failed_allocation():
    quant = load_quant_kernels()
    if quant is None:
        pytest.skip("quantized-linear C kernels could not be built here")
    g = gen(3)
    linear = quant.bind(quantize_int8(torch.randn(32, 64, generator=g), group_size=32))
    x = torch.randn(2, 64, generator=g)  # two rows: the padded input copy (one row may take the no-copy path)
    assert_fails_then_recovers(lambda: linear(x, THREADS), quant.fail_allocs_after, 0, "quantized linear")


@pytest.mark.parametrize("allocs_before_failure", [0, 1])  # the input copy, then (AVX2) its chunk sums
def test_k_quant_linear_reports_each_failed_allocation(allocs_before_failure):
    from engine.quant.kquants import quantize_q4_k

    quant = load_quant_kernels()
    if quant is None:
        pytest.skip("quantized-linear C kernels could not be built here")
    g = torch.Generator().manual_seed(0)
    linear = quant.bind(quantize_q4_k(torch.randn(16, 512, generator=g)))
    x = torch.randn(3, 512, generator=g)
    if allocs_before_failure == 1 and not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        pytest.skip("one allocation only without AVX2")
    assert_fails_then_recovers(lambda: linear(x, THREADS), quant.fail_allocs_after, allocs_before_failure, "quantized linear")


def test_the_engine_fails_the_step_and_keeps_serving(kernels, failing, tiny_checkpoint):
    """A real CPU model whose kernels cannot allocate: the step's requests finish with an error naming
    it; once memory is back, the next request is served exactly as it would have been."""
    from engine.core.engine_core import EngineCore
    from engine.loading.checkpoint import resolve_checkpoint
    from tests.conftest import TINY_DESCRIPTOR
    from tests.engine.test_engine_real import MAX_SEQ_LEN, TOK, config, make_requests, make_runner

    spec = resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    cfg = config(spec, dtype="float32")
    core = EngineCore(make_runner(spec, cfg), TOK, cfg, MAX_SEQ_LEN)
    first, second = make_requests(2)
    try:
        core.add_request(first)
        [prefilled] = core.step()  # the prompt's pass and its first token
        assert prefilled.new_token_ids and not prefilled.finished
        assert core.runner._workers._shard.model.decode_step is not None
        failing(0)
        [failed] = core.step()  # one decode: the compiled decode step, whose first linear cannot allocate
        assert failed.finish_reason == "error" and "MemoryError: decode step" in failed.error, failed.error
        assert not core.has_unfinished
        failing(-1)
        served = {}
        for request in (second, first):  # the failed request again, now served in full
            core.add_request(type(request)(request.request_id + "-again", request.prompt_token_ids, request.params))
            while core.has_unfinished:
                for out in core.step():
                    served.setdefault(out.request_id, []).append(out)
        assert all(outs[-1].finish_reason == "length" for outs in served.values())
        assert core.pool.num_free == core.pool.num_blocks
    finally:
        core.runner.shutdown()
