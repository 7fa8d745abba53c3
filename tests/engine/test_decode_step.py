"""The compiled batch-1 decode step (engine/backends/cpu_step.py, engine/csrc/decode_step.c) gives
the per-op path's logits, for float32 and bfloat16 dense weights and every quantized format with a
one-row kernel (ours and GGUF's Q4_0 / Q4_1 / Q8_0 kept native, tied heads included); steps it
does not cover and weights without a one-row form run the per-op path."""

from __future__ import annotations

import pytest
import torch

from engine.backends import cpu_step
from engine.backends.cpu_step import DecodeStep
from engine.quant.linear import QuantLinear
from tests.engine.test_model import make_executor, random_prompts, run_random_schedule

if cpu_step._load_library() is None:
    pytest.skip("no C compiler: the decode step cannot be built", allow_module_level=True)

PROMPT_LENGTHS = [5, 11, 8]
MAX_NEW = 8


class Counting:
    """The model's decode step, counting the steps it ran (the comparison must exercise it)."""

    def __init__(self, step: DecodeStep) -> None:
        self.step, self.ran = step, 0

    def __call__(self, h, meta, kv_caches):
        out = self.step(h, meta, kv_caches)
        self.ran += out is not None
        return out


def compare_with_and_without(executor, prompts: list[list[int]]) -> tuple[dict, dict, int]:
    """run_random_schedule twice on one executor: with the decode step (counted), then without."""
    model = executor._shard.model
    assert model.decode_step is not None
    counting = Counting(model.decode_step)
    model.decode_step = counting
    with_step = run_random_schedule(executor, prompts, seed=5, max_new=MAX_NEW)
    model.decode_step = None
    without = run_random_schedule(executor, prompts, seed=5, max_new=MAX_NEW)
    model.decode_step = counting.step
    return with_step, without, counting.ran


def assert_same_run(with_step: dict, without: dict, ran: int) -> None:
    assert ran > 0
    for seq_id, (logits, tokens) in without.items():
        got_logits, got_tokens = with_step[seq_id]
        assert got_tokens == tokens  # greedy tokens
        # the same kernels in the same order: equal but for summation order (threads)
        torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", [None, "int8", "int4_mixed", "fp8_mixed"])
def test_decode_step_matches_per_op_path(tiny_checkpoint, dtype, quantization):
    executor = make_executor(tiny_checkpoint, dtype=dtype, quantization=quantization)
    try:
        model = executor._shard.model
        if dtype == "bfloat16" and quantization == "int8":  # per-row int8 in bfloat16 runs torch's op at one row
            assert model.decode_step is None
            return
        if quantization is not None:
            assert isinstance(model.layers[0].attention.wqkv, QuantLinear)
        assert_same_run(*compare_with_and_without(executor, random_prompts(256, PROMPT_LENGTHS, seed=4)))
    finally:
        executor.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_steps_one_row_weights_lie_in_one_arena_in_step_order(tiny_checkpoint, dtype):
    """build_decode_step moves every block linear's one-row copy into one WeightArena (huge pages),
    in the order the step reads them, and the per-op path's one-row calls read the same copies."""
    executor = make_executor(tiny_checkpoint, dtype=dtype)
    try:
        model = executor._shard.model
        assert model.decode_step is not None
        linears = [linear for block in model.layers for linear in cpu_step._block_linears(block)]
        addresses = [linear.interleaved.data_ptr() for linear in linears]
        storages = {linear.interleaved.untyped_storage().data_ptr() for linear in linears}
        assert len(storages) == 1 and addresses == sorted(addresses)
        program_addresses = [getattr(layer, name).weight for layer in model.decode_step._layers[: len(model.layers)] for name in cpu_step._BLOCK_LINEARS]
        assert program_addresses == addresses
        x = torch.randn(1, linears[0].in_features).to(getattr(torch, dtype))
        torch.testing.assert_close(linears[0](x), linears[0]._onednn(x), rtol=2e-2, atol=2e-2)  # the moved copy serves one row
    finally:
        executor.shutdown()


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1", "Q8_0"])
def native_gguf(request, tmp_path_factory):
    """A tiny GGUF with its matrices (and tied embedding) in one of llama.cpp's block formats,
    imported with them kept native."""
    gguf = pytest.importorskip("gguf")
    from engine.offline.gguf_import import import_gguf
    from tests.engine.test_gguf_import import hf_weights, write_gguf

    tmp = tmp_path_factory.mktemp(f"native_{request.param}")
    write_gguf(tmp / "tiny.gguf", hf_weights(seed=1, tied=True), qtype=gguf.GGMLQuantizationType[request.param])
    return import_gguf(tmp / "tiny.gguf", tmp / "ckpt", progress=False, keep_quantized=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_on_native_gguf_blocks(native_gguf, dtype):
    from engine.checkpoint import resolve_checkpoint
    from engine.config import EngineConfig
    from engine.executor import ModelExecutor

    spec = resolve_checkpoint(native_gguf, model_id="tiny-gguf")
    executor = ModelExecutor(spec, EngineConfig(dtype=dtype, block_size_tokens=4, max_batch_size=8, kv_cache_bytes=1 << 20), max_seq_len=64)
    try:
        model = executor._shard.model
        assert isinstance(model.layers[0].feed_forward.w13, QuantLinear) and isinstance(model.output, QuantLinear)  # tied head: quantized
        assert_same_run(*compare_with_and_without(executor, random_prompts(spec.model_args.vocab_size, PROMPT_LENGTHS, seed=6)))
    finally:
        executor.shutdown()


def test_weights_without_a_one_row_form_run_the_per_op_path(tiny_checkpoint, monkeypatch):
    import engine.backends.cpu as cpu

    monkeypatch.setattr(cpu, "INTERLEAVED_MAX_WEIGHT_BYTES", 0)  # no interleaved copies
    executor = make_executor(tiny_checkpoint, dtype="float32")
    try:
        assert executor._shard.model.decode_step is None
    finally:
        executor.shutdown()


@pytest.mark.parametrize("missing", ["step library", "quantized kernels"])
def test_without_its_kernels_the_model_runs_op_by_op(tiny_checkpoint, monkeypatch, missing):
    import engine.quant.kernels as quant_kernels

    if missing == "step library":
        monkeypatch.setattr(cpu_step, "_load_library", lambda: None)
    else:
        monkeypatch.setattr(quant_kernels, "load_quant_kernels", lambda: None)  # QuantLinear: torch path
    executor = make_executor(tiny_checkpoint, dtype="float32", quantization="int8")
    try:
        assert executor._shard.model.decode_step is None
        results = run_random_schedule(executor, random_prompts(256, [4], seed=2), seed=1, max_new=2)
        assert all(torch.isfinite(logits).all() for logits, _ in results.values())
    finally:
        executor.shutdown()


def test_other_steps_are_left_to_the_per_op_path(tiny_checkpoint):
    """A prefill, or several sequences' decodes: the step returns None and leaves h untouched."""
    from engine.runner import build_step_inputs
    from engine.sequence import ScheduledBatch, Sequence
    from engine.types import SamplingParams

    executor = make_executor(tiny_checkpoint, dtype="float32")
    try:
        model, caches = executor._shard.model, executor._shard.kv_caches
        seqs = [Sequence(i, f"r{i}", [3, 4, 5], 3, SamplingParams(temperature=0.0)) for i in range(2)]
        for i, seq in enumerate(seqs):
            seq.block_table = [i]
        for counts in ([3], [3, 3]):
            batch = ScheduledBatch(seqs[: len(counts)], counts)
            inputs = build_step_inputs(batch, executor.block_size)[0]
            meta = model.backend.attention_metadata(inputs, model.freqs_cis, caches[0])
            h = torch.randn(inputs.num_tokens, model.params.dim)
            before = h.clone()
            assert model.decode_step(h, meta, caches) is None
            assert torch.equal(h, before)
    finally:
        executor.shutdown()


def test_engine_greedy_generation_same_with_and_without_the_step(tiny_checkpoint):
    """Through EngineCore (scheduler, sampler, one request at a time so that every decode step is
    one token of one sequence): the same tokens with the decode step as without it."""
    from engine.checkpoint import resolve_checkpoint
    from engine.core import EngineCore
    from tests.conftest import TINY_DESCRIPTOR
    from tests.engine.test_engine_real import MAX_SEQ_LEN, TOK, config, make_requests, make_runner

    spec = resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    cfg = config(spec, dtype="float32", enable_prefix_caching=False)
    core = EngineCore(make_runner(spec, cfg), TOK, cfg, MAX_SEQ_LEN)
    model = core.runner._executor._shard.model
    counting = Counting(model.decode_step)
    try:
        results = {}
        for use_step in (True, False):
            model.decode_step = counting if use_step else None
            for request in make_requests(6):
                core.add_request(request)
                tokens = []
                while core.has_unfinished:
                    for out in core.step():
                        tokens += out.new_token_ids
                results.setdefault(request.request_id, []).append(tokens)
        assert counting.ran > 0
        assert all(with_step == without for with_step, without in results.values())
    finally:
        core.runner.shutdown()
