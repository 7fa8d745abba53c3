"""The engine on a CUDA device, against the same checkpoint on the CPU: the forward (float64 logits
equal to the CPU's, bfloat16 close to them), every quantization type through its CUDA kernel, and
EngineCore's batching, chunking and prefix cache. Skipped without a GPU; run them where one is
lent (.ci/cuda)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.quant import QUANTIZATION_TYPES
from engine.types import EngineRequest, SamplingParams
from tests.engine.fakes import ByteTokenizer
from tests.conftest import TINY_DESCRIPTOR
from tests.engine.test_model import BLOCK_SIZE, random_prompts, run_random_schedule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")

PROMPT_LENGTHS = [5, 11, 8, 17, 3]
MAX_NEW = 6
KV_CACHE_BYTES = 64 << 20  # not the default 90% of the card: each test's executor takes its own
# torch._scaled_mm quantizes the activations per row to e4m3 as well (w8a8, as meta-reference's
# fbgemm f8f8bf16_rowwise does), so its bound is looser than the CPU's weight-only fp8 path's
# (tests/engine/test_quant_model.py): measured on an H200, 0.091 on the tiny Llama 3 and 0.194 on the
# tiny Llama 4 (random weights, nearly flat logits); per linear, the kernel equals its dequantized
# reference (tests/engine/test_quant_cuda.py)
SCALED_MM_MAX_RELATIVE_ERROR = 0.25


def _run(checkpoint, prompts, *, descriptor: str = TINY_DESCRIPTOR, **config):
    executor = _executor(checkpoint, descriptor, **config)
    try:
        return executor, run_random_schedule(executor, prompts, seed=5, max_new=MAX_NEW)
    finally:
        executor.shutdown()


def _executor(checkpoint, descriptor: str = TINY_DESCRIPTOR, **config):
    """tests/engine/test_model.py's make_executor for any descriptor, with this file's KV cache size."""
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.executor.worker_group import WorkerGroup

    spec = resolve_checkpoint(checkpoint, model_id="tiny", llama_model=descriptor)
    config = EngineConfig(block_size_tokens=BLOCK_SIZE, max_batch_size=8, kv_cache_bytes=KV_CACHE_BYTES, **config)
    return WorkerGroup(spec, config, max_seq_len=64)


def _worst_relative_error(results, reference) -> tuple[float, int, int]:
    """max |logit - reference| / max |reference|, and greedy agreement (teacher-forced)."""
    worst, agree, total = 0.0, 0, 0
    for seq_id, (ref_logits, _) in reference.items():
        logits = results[seq_id][0][: ref_logits.shape[0]].double()
        ref = ref_logits.double()
        worst = max(worst, float((logits - ref).abs().max() / ref.abs().max()))
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
    return worst, agree, total


@pytest.fixture(scope="module")
def cpu_float64(tiny_checkpoint, tiny_model_args):
    prompts = random_prompts(tiny_model_args.vocab_size, PROMPT_LENGTHS, seed=4)
    return prompts, _run(tiny_checkpoint, prompts, dtype="float64")[1]


def test_float64_on_cuda_equals_the_cpu(tiny_checkpoint, cpu_float64):
    """Random chunking, prefill and decode rows mixed in one step: the CUDA backend's paged KV cache,
    SDPA and cuBLAS give the CPU's logits to float64 rounding, and so the same greedy tokens."""
    prompts, reference = cpu_float64
    executor, results = _run(tiny_checkpoint, prompts, dtype="float64", device="cuda")
    assert executor._shard.device.type == "cuda" and executor._shard.model.backend.name == "cuda"
    for seq_id, (ref_logits, ref_tokens) in reference.items():
        logits, tokens = results[seq_id]
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_low_precision_on_cuda_is_close_to_float64(tiny_checkpoint, cpu_float64, dtype):
    prompts, reference = cpu_float64
    sequences = [tokens for _, tokens in reference.values()]  # teacher-forced on the float64 tokens
    _, results = _run(tiny_checkpoint, sequences, dtype=dtype, device="cuda")
    worst, agree, total = _worst_relative_error(results, reference)
    print(f"\ncuda {dtype}: max |logit error| / max |logit| {worst:.5f}, greedy agreement {agree}/{total}")
    assert worst < (0.03 if dtype == "bfloat16" else 1e-5)
    assert agree >= (0.85 if dtype == "bfloat16" else 1.0) * total


@pytest.mark.parametrize("name", sorted(QUANTIZATION_TYPES))
def test_each_quantization_runs_on_its_cuda_kernel(tmp_path, tiny_model_args, name):
    """Every QUANTIZATION_TYPE against the float32 model on the same device, teacher-forced, within
    the bounds the CPU's quantized paths meet (tests/engine/test_quant_model.py), on the kernel
    engine.quant.cuda.plan picks for this card."""
    from engine.loading.checkpoint import write_random_checkpoint
    from engine.quant.cuda import SCALED_MM_ROWWISE_MIN_CAPABILITY, TINYGEMM_MIN_CAPABILITY, CudaQuantLinear, kernel_formats
    from tests.engine.test_quant_model import MAX_RELATIVE_ERROR, MIN_AGREEMENT

    capability = tuple(torch.cuda.get_device_capability())
    if QUANTIZATION_TYPES[name].format not in kernel_formats(capability):
        pytest.skip(f"{name}: no kernel on compute capability {capability}")
    checkpoint = write_random_checkpoint(tmp_path, dataclasses.replace(tiny_model_args, multiple_of=64), seed=8)
    prompts = random_prompts(tiny_model_args.vocab_size, PROMPT_LENGTHS, seed=7)
    _, reference = _run(checkpoint, prompts, dtype="float32", device="cuda")
    executor = _executor(checkpoint, dtype="bfloat16", device="cuda", quantization=name)
    try:
        linears = [m for m in executor._shard.model.modules() if isinstance(m, CudaQuantLinear)]
        paths = {m.path for m in linears}
        results = run_random_schedule(executor, [tokens for _, tokens in reference.values()], seed=5, max_new=MAX_NEW)
    finally:
        executor.shutdown()
    assert len(linears) == 4 * tiny_model_args.n_layers
    # the tiny model's widths (multiples of 64) suit the fast kernels wherever the card has them
    fast = {"fp8_mixed": ("scaled_mm", SCALED_MM_ROWWISE_MIN_CAPABILITY), "int4_mixed": ("tinygemm", TINYGEMM_MIN_CAPABILITY)}
    path, minimum = fast.get(name, ("dequant_mm", (0, 0)))
    assert paths == ({path} if capability >= minimum else {"dequant_mm"}), paths
    worst, agree, total = _worst_relative_error(results, reference)
    print(f"\ncuda {name} via {paths}: max |logit error| / max |logit| {worst:.4f}, greedy agreement {agree}/{total}")
    bound = SCALED_MM_MAX_RELATIVE_ERROR if paths == {"scaled_mm"} else MAX_RELATIVE_ERROR[name] + 0.02  # + bf16 activations
    assert worst < bound
    assert agree >= MIN_AGREEMENT[name] * total


@pytest.fixture(scope="module")
def llama4_checkpoint(tmp_path_factory):
    from tests.llama4_fixtures import write_tiny_llama4_checkpoint

    return write_tiny_llama4_checkpoint(tmp_path_factory.mktemp("llama4_cuda"))


def test_llama4_on_cuda(llama4_checkpoint):
    """The tiny Llama 4 (MoE with top-2 routing, chunked attention, a NoPE layer, qk-norm): float64
    on the GPU gives the CPU's logits; fp8_mixed (Scout's and Maverick's shipped quantization) runs
    on the GPU's fp8 kernel within the bound the CPU path meets."""
    from engine.quant.cuda import CudaQuantLinear
    from tests.llama4_fixtures import TINY_LLAMA4_DESCRIPTOR

    prompts = random_prompts(256, [9, 20, 4, 13], seed=3)  # past the chunk size (8) of chunked attention
    _, reference = _run(llama4_checkpoint, prompts, descriptor=TINY_LLAMA4_DESCRIPTOR, dtype="float64")
    _, results = _run(llama4_checkpoint, prompts, descriptor=TINY_LLAMA4_DESCRIPTOR, dtype="float64", device="cuda")
    for seq_id, (ref_logits, ref_tokens) in reference.items():
        assert results[seq_id][1] == ref_tokens
        torch.testing.assert_close(results[seq_id][0], ref_logits, atol=1e-9, rtol=1e-9)
    sequences = [tokens for _, tokens in reference.values()]
    executor = _executor(llama4_checkpoint, TINY_LLAMA4_DESCRIPTOR, dtype="bfloat16", device="cuda", quantization="fp8_mixed")
    try:
        paths = {m.path for m in executor._shard.model.modules() if isinstance(m, CudaQuantLinear)}
        quantized = run_random_schedule(executor, sequences, seed=5, max_new=MAX_NEW)
    finally:
        executor.shutdown()
    worst, agree, total = _worst_relative_error(quantized, reference)
    print(f"\ncuda llama4 fp8_mixed via {paths}: max |logit error| / max |logit| {worst:.4f}, greedy agreement {agree}/{total}")
    assert paths == {"scaled_mm"} and worst < SCALED_MM_MAX_RELATIVE_ERROR


def _tokens(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[int]]:
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while core.has_unfinished:
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def _core(tiny_checkpoint, device: str, **overrides) -> EngineCore:
    from engine.loading.checkpoint import resolve_checkpoint
    from engine.executor.worker_group import WorkerGroup
    from engine.executor.executor import ModelExecutor

    spec = resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    config = EngineConfig(**{"device": device, "dtype": "float64", "block_size_tokens": 4, "max_batch_size": 16,
                             "max_num_batched_tokens": 48, "max_prefill_chunk_tokens": 0, "kv_cache_bytes": KV_CACHE_BYTES, **overrides})
    return EngineCore(ModelExecutor(WorkerGroup(spec, config, max_seq_len=64)), ByteTokenizer(), config, 64)


def test_engine_core_on_cuda_gives_the_cpu_tokens(tiny_checkpoint):
    """Sixteen requests batched and chunked on the GPU, half of them behind a shared cached prefix,
    some sampled with a seed: the tokens the CPU engine gives each one run alone."""
    import random

    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(13)]
    requests = []
    for i in range(16):
        prompt = (prefix if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randint(1, 25))]
        sampling = dict(temperature=0.8, top_p=0.9, seed=50 + i) if i % 3 == 0 else dict(temperature=0.0)
        requests.append(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=min(12, 63 - len(prompt)), **sampling)))
    gpu = _core(tiny_checkpoint, "cuda")
    try:
        batched = _tokens(gpu, requests)
        hits = gpu.stats().prefix_cache_hits_total
    finally:
        gpu.runner.shutdown()
    cpu = _core(tiny_checkpoint, "cpu", enable_prefix_caching=False, max_batch_size=1)
    try:
        alone = {r.request_id: _tokens(cpu, [r])[r.request_id] for r in requests}
    finally:
        cpu.runner.shutdown()
    assert batched == alone
    assert hits > 0
