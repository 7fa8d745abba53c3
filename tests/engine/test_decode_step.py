"""The compiled decode step (engine/backends/cpu_step.py, engine/kernels/csrc/decode_step.c) gives the
per-op path's logits: at one decode for float32 and bfloat16 dense weights and every quantized
format with a one-row kernel (ours and GGUF's Q4_0 / Q4_1 / Q8_0 kept native, tied heads included),
at 2..AMX_MAX_ROWS decodes for bfloat16 on the pairs copies' many-rows kernel (AMX tiles, or without
them on AVX512_BF16 CPUs linear.c's pairs gemm) and at 2..N decodes through the interleaved
linears' few-rows kernel without them, and past N through gemm.c where it takes those rows (float32,
and bfloat16 without oneDNN's bfloat16) (bit for bit); steps it does not cover and weights without a
one-row (many-row) form run the per-op path."""

from __future__ import annotations

import pytest
import torch

from engine.backends import cpu_step
from engine.backends.base import AttentionPath
from engine.backends.cpu import WIDEN_MIN_ROWS, InterleavedHead
from engine.backends.cpu_step import DecodeStep
from engine.kernels.decode_step import BLOCK_LINEARS, load_decode_step_library
from engine.quant.linear import QuantLinear
from tests.engine.test_model import make_executor, random_prompts, run_random_schedule

if load_decode_step_library() is None:
    pytest.skip("no C compiler: the decode step cannot be built", allow_module_level=True)

# bfloat16 models get the compiled step on every CPU: on oneDNN's bfloat16 where it has that (AVX-512
# class CPUs), else (AVX2) on the kernels alone (CpuKernelBackend.onednn False)
DTYPES = ["float32", "bfloat16"]

PROMPT_LENGTHS = [5, 11, 8]
MAX_NEW = 8


class Counting:
    """The model's decode step, counting the steps it ran (the comparison must exercise it)."""

    def __init__(self, step: DecodeStep) -> None:
        self.step, self.ran = step, 0
        self.max_rows = step.max_rows  # what the step's plan reads

    def __call__(self, h, meta, kv_caches):
        out = self.step(h, meta, kv_caches)
        self.ran += 1
        return out


def plan(model, inputs, caches):
    """The backend's plan for this step, as the model's forward makes it."""
    return model.backend.plan_step(inputs, model.freqs_cis, caches[0], model.decode_step)


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


@pytest.mark.parametrize("dtype", DTYPES)
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_steps_one_row_weights_lie_in_one_arena_in_step_order(tiny_checkpoint, dtype):
    """build_decode_step moves every block linear's one-row copy into one WeightArena (huge pages),
    in the order the step reads them, and the per-op path's one-row calls read the same copies."""
    executor = make_executor(tiny_checkpoint, dtype=dtype)
    try:
        model = executor._shard.model
        assert model.decode_step is not None
        linears = [linear for block in model.layers for linear in cpu_step.block_linears(block)]
        addresses = [linear.interleaved.data_ptr() for linear in linears]
        storages = {linear.interleaved.untyped_storage().data_ptr() for linear in linears}
        assert len(storages) == 1 and addresses == sorted(addresses)
        program_addresses = [getattr(layer, name).weight for layer in model.decode_step._layers[: len(model.layers)] for name in BLOCK_LINEARS]
        assert program_addresses == addresses
        x = torch.randn(1, linears[0].in_features).to(getattr(torch, dtype))
        # the moved copy serves one row; the many-rows path (oneDNN's copy, or widened tiles of the moved copy) agrees
        many = linears[0]._onednn(x) if linears[0].packed_weight is not None else linears[0](x.expand(WIDEN_MIN_ROWS, -1))[:1]
        torch.testing.assert_close(linears[0](x), many, rtol=2e-2, atol=2e-2)
    finally:
        executor.shutdown()


def test_the_bfloat16_head_follows_the_blocks_in_their_arena(tiny_checkpoint):
    """The one-row output head (InterleavedHeadLinear: bfloat16 weights, float32 logits) moves into the
    blocks' arena right after the last block's weights, the next thing a step reads; every row count
    it serves (one row, and the many-rows path) reads the moved copy and gives what the copy it had gives."""
    executor = make_executor(tiny_checkpoint, dtype="bfloat16")
    try:
        model = executor._shard.model
        assert model.decode_step is not None
        head, last = model.output, model.layers[-1].feed_forward.w2
        assert head.interleaved.untyped_storage().data_ptr() == last.interleaved.untyped_storage().data_ptr()
        assert head.interleaved.data_ptr() >= last.interleaved.data_ptr() + last.interleaved.numel() * last.interleaved.element_size()
        unmoved = type(head)(InterleavedHead(head.interleaved.clone(), head.out_features, head.in_features), head._kernels, widen=head._widens, amx=head._amx_kernels)
        for rows in (1, WIDEN_MIN_ROWS + 1):
            x = torch.randn(rows, head.in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
            assert torch.equal(head(x), unmoved(x)), rows
    finally:
        executor.shutdown()


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1", "Q8_0"])
def native_gguf(request, tmp_path_factory):
    """A tiny GGUF with its matrices (and tied embedding) in one of llama.cpp's block formats,
    imported with them kept native."""
    gguf = pytest.importorskip("gguf")
    from engine.loading.gguf_import import import_gguf
    from tests.engine.test_gguf_import import hf_weights, write_gguf

    tmp = tmp_path_factory.mktemp(f"native_{request.param}")
    write_gguf(tmp / "tiny.gguf", hf_weights(seed=1, tied=True), qtype=gguf.GGMLQuantizationType[request.param])
    return import_gguf(tmp / "tiny.gguf", tmp / "ckpt", progress=False, keep_quantized=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_step_on_native_gguf_blocks(native_gguf, dtype):
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.config import EngineConfig
    from engine.executor.worker_group import WorkerGroup

    spec = resolve_checkpoint(native_gguf, model_id="tiny-gguf")
    executor = WorkerGroup(spec, EngineConfig(dtype=dtype, block_size_tokens=4, max_batch_size=8, kv_cache_bytes=1 << 20), max_seq_len=64)
    try:
        model = executor._shard.model
        assert isinstance(model.layers[0].feed_forward.w13, QuantLinear) and isinstance(getattr(model.output, "local", model.output), QuantLinear)  # tied head: quantized (widened to float32 in bfloat16)
        assert_same_run(*compare_with_and_without(executor, random_prompts(spec.model_args.vocab_size, PROMPT_LENGTHS, seed=6)))
    finally:
        executor.shutdown()


def test_weights_without_a_one_row_form_run_the_per_op_path(tiny_checkpoint, monkeypatch):
    import engine.backends.cpu as cpu

    monkeypatch.setattr(cpu, "INTERLEAVED_MAX_WEIGHT_BYTES", 0)  # no interleaved copies
    monkeypatch.setattr(cpu, "gemm_serves", lambda *_: False)  # nor the gemm's copy in place of oneDNN's (AVX2 float32)
    executor = make_executor(tiny_checkpoint, dtype="float32")
    try:
        assert executor._shard.model.decode_step is None
    finally:
        executor.shutdown()


@pytest.mark.parametrize("missing", ["step library", "quantized kernels"])
def test_without_its_kernels_the_model_runs_op_by_op(tiny_checkpoint, monkeypatch, missing):
    import engine.kernels.quant as quant_kernels

    if missing == "step library":
        monkeypatch.setattr(cpu_step, "load_decode_step_library", lambda: None)
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
    """A prefill of one sequence, or of several: the plan runs the blocks op by op."""
    from engine.executor.executor import build_step_inputs
    from engine.core.sequence import ScheduledBatch, Sequence
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
            assert not plan(model, inputs, caches).compiled
    finally:
        executor.shutdown()


def test_engine_greedy_generation_same_with_and_without_the_step(tiny_checkpoint):
    """Through EngineCore (scheduler, sampler, one request at a time so that every decode step is
    one token of one sequence): the same tokens with the decode step as without it."""
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.core.engine_core import EngineCore
    from tests.conftest import TINY_DESCRIPTOR
    from tests.engine.test_engine_real import MAX_SEQ_LEN, TOK, config, make_requests, make_runner

    spec = resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    cfg = config(spec, dtype="float32", enable_prefix_caching=False)
    core = EngineCore(make_runner(spec, cfg), TOK, cfg, MAX_SEQ_LEN)
    model = core.runner._workers._shard.model
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


# --------------------------------------------------------------------------- many decodes (pairs copies)
# bfloat16 block linears on their pairs copies: AMX tiles, or without them (AVX512_BF16 CPUs such as Zen
# 4) linear.c's pairs gemm. A shape whose attention also runs on the tiles (head_dim 64, 16-key blocks: pa_amx_applies) and
# whose linears all have k a multiple of 32 (the AMX kernel's K_STEP).
MANY_ARGS = dict(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=512, multiple_of=128, rope_theta=100000.0)
MANY_BLOCK_SIZE = 16
MANY_BLOCKS_PER_SEQ = 20
# context lengths (with this step's token) cycled over the sequences: a first token, the last slot
# of a block and the first of the next (16 / 17, 32 / 33), and longer ones across many blocks
MANY_CONTEXTS = [1, 16, 17, 5, 32, 33, 100, 160, 257, 63, 64, 65, 2, 200]


def _amx_model(dtype: torch.dtype = torch.bfloat16):
    from engine.backends import select_backend
    from engine.loading.checkpoint import random_state_dict
    from engine.models.args import ModelArgs
    from engine.config import EngineConfig
    from engine.models.llama import Transformer

    args = ModelArgs(**MANY_ARGS)
    backend = select_backend(EngineConfig(dtype=str(dtype).removeprefix("torch.")), torch.device("cpu"))
    if backend.name != "cpu_kernels":
        pytest.skip(f"the fused kernels are unavailable here (backend {backend.name})")
    return Transformer.from_state_dict(args, random_state_dict(args, seed=3, dtype=dtype), backend, max_seq_len=512)


def pairs_many_rows_here() -> str | None:
    """Which kernel runs a bfloat16 model's 2+ rows on the pairs copies here: "amx", "pairs gemm"
    (AVX512_BF16 without tiles, beside oneDNN's bfloat16), or None (the steps of many decodes run op by op)."""
    from engine.backends.cpu import packing_available
    from engine.kernels.amx import load_amx_linear
    from engine.kernels.cpu import load_cpu_kernels

    if load_amx_linear() is not None:
        return "amx"
    kernels = load_cpu_kernels()
    if kernels is not None and kernels.address("pairs_gemm_bf16") is not None and packing_available(torch.bfloat16):
        return "pairs gemm"
    return None


@pytest.fixture(scope="module")
def amx_model():
    """The bfloat16 many-decodes model, its 2+ rows on the pairs copies (AMX tiles or the pairs gemm)."""
    kind = pairs_many_rows_here()
    if kind is None:
        pytest.skip("no AMX tiles nor AVX512_BF16's pairs gemm on this CPU: steps of many decodes run op by op")
    model = _amx_model()
    assert model.decode_step is not None and model.decode_step.max_rows == cpu_step_max_rows()
    assert model.decode_step._program.tile_rows == (16 if kind == "amx" else 1)
    return model


def cpu_step_max_rows() -> int:
    from engine.backends.cpu import AMX_MAX_ROWS

    return AMX_MAX_ROWS


def _caches(model, seed: int):
    from engine.models.llama import allocate_kv_caches

    # every sequence a step of the model may serve, and one more (a step past its bound)
    num_blocks = (max(cpu_step_max_rows(), getattr(model.decode_step, "max_rows", 1)) + 1) * MANY_BLOCKS_PER_SEQ
    caches = allocate_kv_caches(model.params, 1, num_blocks, MANY_BLOCK_SIZE, dtype=model.backend.dtype, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for k_cache, v_cache in caches:  # K/V already cached for every context, random
        k_cache.copy_(torch.randn(k_cache.shape, generator=gen)), v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    return caches


def _step(num_seqs: int, new_tokens: list[int] | None = None):
    """build_step_inputs for num_seqs sequences at MANY_CONTEXTS' lengths (new_tokens each: 1)."""
    from engine.executor.executor import build_step_inputs
    from engine.core.sequence import ScheduledBatch, Sequence
    from engine.types import SamplingParams

    new_tokens = new_tokens or [1] * num_seqs
    seqs = []
    for i, new in enumerate(new_tokens):
        context = max(MANY_CONTEXTS[i % len(MANY_CONTEXTS)], new)
        seq = Sequence(i, f"r{i}", [(i * 31 + j) % 500 for j in range(context)], 1, SamplingParams(temperature=0.0))
        seq.block_table = list(range(i * MANY_BLOCKS_PER_SEQ, (i + 1) * MANY_BLOCKS_PER_SEQ))
        seq.num_computed_tokens = context - new
        seqs.append(seq)
    return build_step_inputs(ScheduledBatch(seqs, new_tokens), MANY_BLOCK_SIZE)[0]


def _with_and_without_step(model, inputs, caches, per_op_caches) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(times the compiled step ran, the model's logits with it on `caches`, without it on
    `per_op_caches`); the model keeps its step afterwards."""
    counting = Counting(model.decode_step)
    model.decode_step = counting
    try:
        with_step = model(inputs, caches)
        model.decode_step = None
        per_op = model(inputs, per_op_caches)
    finally:
        model.decode_step = counting.step
    return counting.ran, with_step, per_op


@pytest.mark.parametrize(("num_seqs", "threads"), [(2, 2), (2, 1), (17, 2), (32, 2), (64, 2), (64, 1)])
def test_many_decodes_in_one_call_equal_the_per_op_path_bit_for_bit(amx_model, num_seqs, threads):
    """bfloat16 on the pairs copies (AMX tiles, or the pairs gemm): the fused step's logits and K/V writes equal the per-op path's exactly
    (same kernels, same order), with the sequences at different lengths, across block boundaries,
    through both paged kernels where the tiles take many decodes (2 decodes on 2 threads:
    paged_decode_attention; else paged_attention), else through paged_decode_attention."""
    from engine.kernels.cpu import load_cpu_kernels

    model, old_threads = amx_model, torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        inputs = _step(num_seqs)
        fused_caches, per_op_caches = _caches(model, seed=num_seqs), _caches(model, seed=num_seqs)
        step_plan = plan(model, inputs, fused_caches)
        assert step_plan.compiled
        # both kernels covered where many decodes take paged_attention (AMX tiles); else paged_decode_attention keeps them
        takes_decodes = load_cpu_kernels().paged_attention_takes_decodes(torch.bfloat16)
        assert (step_plan.attention.path is AttentionPath.PAGED_DECODES) == (not takes_decodes or num_seqs < 2 * threads)
        ran, fused, per_op = _with_and_without_step(model, inputs, fused_caches, per_op_caches)
    finally:
        torch.set_num_threads(old_threads)
    assert ran == 1
    assert fused.shape == (num_seqs, MANY_ARGS["vocab_size"]) and torch.isfinite(fused).all()
    assert torch.equal(fused, per_op)
    assert all(torch.equal(a, b) for pair_a, pair_b in zip(fused_caches, per_op_caches) for a, b in zip(pair_a, pair_b))


@pytest.mark.parametrize("kind", ["prefill chunk", "mixed", "past the bound"])
def test_steps_the_many_row_step_does_not_serve_run_the_per_op_path(amx_model, kind):
    """A prefill chunk, decodes mixed with prefill chunks (on AMX one paged_attention call takes them
    all), more decodes than AMX_MAX_ROWS: the plan runs the blocks op by op, and the model's
    logits (so its tokens) are those of the per-op path."""
    model = amx_model
    new_tokens = {"prefill chunk": [20], "mixed": [1, 1, 1, 17, 1], "past the bound": [1] * (cpu_step_max_rows() + 1)}[kind]
    inputs = _step(len(new_tokens), new_tokens)
    caches, per_op_caches = _caches(model, seed=1), _caches(model, seed=1)
    assert not plan(model, inputs, caches).compiled
    ran, with_step, per_op = _with_and_without_step(model, inputs, caches, per_op_caches)
    assert ran == 0
    assert torch.equal(with_step, per_op) and torch.equal(with_step.argmax(-1), per_op.argmax(-1))


def few_rows_cutoff() -> int:
    """The most rows the loaded kernels' build sends through the interleaved linears (8 on AVX2, else 1)."""
    from engine.backends.cpu import few_rows_cutoff as cutoff
    from engine.kernels.cpu import load_cpu_kernels

    return cutoff(load_cpu_kernels())


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def tileless_model(request):
    """The many-decodes model without AMX tiles: float32, and bfloat16 where neither the tiles nor
    oneDNN's bfloat16 take its rows (AVX2 CPUs: every block linear on its interleaved copy alone)."""
    from engine.backends.cpu import packing_available
    from engine.kernels.amx import load_amx_linear

    dtype = getattr(torch, request.param)
    if dtype == torch.bfloat16 and (load_amx_linear() is not None or packing_available(dtype)):
        pytest.skip("bfloat16 rows run on AMX tiles or oneDNN here (their own tests)")
    model = _amx_model(dtype)
    assert model.decode_step is not None
    return model


def gemm_step_rows() -> int:
    """The most decodes a compiled step without tiles serves: where csrc/gemm.c takes the block linears'
    rows past the few-rows cutoff, its cutoff (64 on AVX-512 builds) up to STEP_GEMM_MAX_ROWS (AVX2's
    2048), else the few-rows cutoff."""
    from engine.backends.cpu_step import STEP_GEMM_MAX_ROWS
    from engine.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    return min(STEP_GEMM_MAX_ROWS, kernels.gemm_max_rows()) if kernels is not None and kernels.gemm_max_rows() > 0 else few_rows_cutoff()


def test_steps_without_tiles_serve_up_to_their_step_rows(tileless_model):
    """float32 (and bfloat16 without oneDNN's bfloat16) has no tiles: the step serves 1..N decodes, N
    the build's few-rows cutoff (the block linears' interleaved kernel takes up to N rows, as in the
    per-op path), or where gemm.c takes the rows past it (AVX2 builds) STEP_GEMM_MAX_ROWS; more run
    op by op. A bfloat16 program then holds gemm.c's float32 scratch (interleaved_gemm_bf16)."""
    model, rows = tileless_model, gemm_step_rows()
    assert model.decode_step.max_rows == rows
    scratch = model.decode_step._program.scratch.contents.gemm_f32
    assert bool(scratch) == (model.backend.dtype == torch.bfloat16 and rows > few_rows_cutoff())
    caches = _caches(model, seed=2)
    assert plan(model, _step(1), caches).compiled and plan(model, _step(rows), caches).compiled
    assert not plan(model, _step(rows + 1), caches).compiled


@pytest.mark.parametrize("threads", [2, 1])
def test_few_decodes_without_tiles_equal_the_per_op_path_bit_for_bit(tileless_model, threads):
    """No AMX (float32; bfloat16 without oneDNN's bfloat16): the fused step's logits and K/V writes at
    every 1..N decodes, and past N where gemm.c takes those rows (bfloat16: x widened and the sums
    rounded by interleaved_gemm_bf16), equal the per-op path's exactly (the same kernels over the
    same rows, the same attention)."""
    model, old_threads = tileless_model, torch.get_num_threads()
    cutoff = few_rows_cutoff()
    past = [n for n in (cutoff + 1, 17, 32, cpu_step_max_rows()) if n <= model.decode_step.max_rows]
    torch.set_num_threads(threads)
    try:
        for num_seqs in [*range(1, cutoff + 1), *past]:
            inputs = _step(num_seqs)
            fused_caches, per_op_caches = _caches(model, seed=num_seqs), _caches(model, seed=num_seqs)
            assert plan(model, inputs, fused_caches).compiled
            ran, fused, per_op = _with_and_without_step(model, inputs, fused_caches, per_op_caches)
            assert ran == 1 and fused.shape == (num_seqs, MANY_ARGS["vocab_size"]) and torch.isfinite(fused).all()
            assert torch.equal(fused, per_op), num_seqs
            assert all(torch.equal(a, b) for pair_a, pair_b in zip(fused_caches, per_op_caches) for a, b in zip(pair_a, pair_b))
    finally:
        torch.set_num_threads(old_threads)


@pytest.mark.parametrize("quantization", ["int4_mixed", "fp8_mixed"])
def test_quantized_linears_have_no_many_row_form(tiny_checkpoint, quantization):
    """Quantized block linears have one-row kernels but no tiles: one decode runs fused, several
    decodes op by op, and a random schedule's tokens and logits are the per-op path's."""
    executor = make_executor(tiny_checkpoint, dtype="bfloat16", quantization=quantization)
    try:
        model = executor._shard.model
        assert model.decode_step is not None and model.decode_step.max_rows == 1
        assert_same_run(*compare_with_and_without(executor, random_prompts(256, PROMPT_LENGTHS, seed=4)))
    finally:
        executor.shutdown()


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_concurrent_greedy_generation_same_with_and_without_many_row_steps(tiny_checkpoint, dtype):
    """Through EngineCore with 16 requests at once (pure-decode steps of many sequences between
    mixed ones): the same tokens with the compiled step as without it, and the step served steps of
    several decodes where the build has them (bfloat16: AMX tiles or the pairs gemm; float32: the few-rows linears)."""
    from engine.backends.cpu import packing_available
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.core.engine_core import EngineCore
    from tests.conftest import TINY_DESCRIPTOR
    from tests.engine.test_engine_real import MAX_SEQ_LEN, TOK, config, make_requests, make_runner

    spec = resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    cfg = config(spec, dtype=dtype, enable_prefix_caching=False)
    core = EngineCore(make_runner(spec, cfg), TOK, cfg, MAX_SEQ_LEN)
    model = core.runner._workers._shard.model
    step, many_rows = model.decode_step, []
    # several decodes in one compiled step: bfloat16 on AMX tiles, or on the few-rows linears where every
    # block linear is an interleaved copy (float32 on AVX2 builds; bfloat16 there too where oneDNN has no
    # bfloat16 kernel)
    few_rows = few_rows_cutoff() > 1 and (dtype == "float32" or not packing_available(torch.bfloat16))
    several = (dtype == "bfloat16" and pairs_many_rows_here() is not None) or few_rows

    def counting(h, meta, kv_caches):
        many_rows.append(h.shape[0] > 1)
        return step(h, meta, kv_caches)

    counting.max_rows = step.max_rows  # what the step's plan reads

    try:
        results = []
        for use_step in (True, False):
            model.decode_step = counting if use_step else None
            tokens: dict[str, list[int]] = {}
            for request in make_requests(16):
                core.add_request(request)
            while core.has_unfinished:
                for out in core.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            results.append(tokens)
        assert results[0] == results[1] and len(results[0]) == 16
        assert any(many_rows) == several
    finally:
        core.runner.shutdown()
