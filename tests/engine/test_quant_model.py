"""Quantized models end to end in the engine (issue 18): each QUANTIZATION_TYPE against the float
model on the tiny checkpoint (greedy agreement and logit error, printed with -s), the resident
weight bytes each saves, the device check, and model parallelism over quantized shards."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.loading.checkpoint import write_random_checkpoint
from engine.quant import QUANTIZATION_TYPES
from engine.quant.linear import QuantLinear
from engine.quant.policy import check_quantization
from engine.types import InvalidRequest
from tests.engine.test_model import make_executor, random_prompts, run_random_schedule

PROMPT_LENGTHS = [5, 11, 8]
MAX_NEW = 6
# Resident bytes of the block linears against float32, at least (codes + scales; the tiny model's
# rows are 64 or 128 wide, so per-row scales cost 0.25-0.5 bits a weight): 8-bit ~3.8x, int4 at
# group 32 (4 bits + float16 scale and min per 32) 6.4x.
MIN_SAVING = {"fp8_mixed": 3.5, "int8": 3.5, "int4_mixed": 6.0}
# Worst logit error relative to the largest float logit, and greedy agreement, measured on the
# tiny random checkpoint (its logits are nearly flat, so argmax is fragile: agreement is loose).
MAX_RELATIVE_ERROR = {"fp8_mixed": 0.08, "int8": 0.02, "int4_mixed": 0.25}
MIN_AGREEMENT = {"fp8_mixed": 0.9, "int8": 0.95, "int4_mixed": 0.7}


def _run(checkpoint, prompts, **kw):
    executor = make_executor(checkpoint, dtype="float32", **kw)
    try:
        results = run_random_schedule(executor, prompts, seed=5, max_new=MAX_NEW)
        model = executor._shard.model
        linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
        blocks = [layer for block in model.layers for layer in (block.attention.wqkv, block.attention.wo, block.feed_forward.w13, block.feed_forward.w2)]
        return results, (executor.weight_bytes, sum(layer.resident_bytes() for layer in blocks)), linears
    finally:
        executor.shutdown()


@pytest.fixture(scope="module")
def float_run(tiny_checkpoint):
    return _run(tiny_checkpoint, random_prompts(256, PROMPT_LENGTHS, seed=4))


@pytest.mark.parametrize("name", sorted(QUANTIZATION_TYPES))
def test_quantized_model_against_float(tiny_checkpoint, tiny_model_args, float_run, name):
    float_results, (float_bytes, float_block_bytes), _ = float_run
    # teacher-forced: the quantized model reads the float model's whole greedy sequences
    sequences = [tokens for _, tokens in float_results.values()]
    results, (quant_bytes, _), linears = _run(tiny_checkpoint, sequences, quantization=name)
    agree, total, worst = 0, 0, 0.0
    for seq_id, (ref_logits, _) in float_results.items():
        logits = results[seq_id][0][: ref_logits.shape[0]]
        agree += int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
        total += ref_logits.shape[0]
        worst = max(worst, float((logits - ref_logits).abs().max() / ref_logits.abs().max()))
    print(f"\n{name}: greedy agreement {agree}/{total}, max |logit error| / max |logit| {worst:.4f}, "
          f"weights {float_bytes} -> {quant_bytes} bytes")  # fmt: skip
    assert worst < MAX_RELATIVE_ERROR[name]
    assert agree >= MIN_AGREEMENT[name] * total
    kind = QUANTIZATION_TYPES[name]
    assert len(linears) == 4 * tiny_model_args.n_layers and {m.weight_q.format for m in linears} == {kind.format}
    linear_float_bytes = sum(m.in_features * m.out_features * 4 for m in linears)
    linear_bytes = sum(m.resident_bytes() for m in linears)
    assert linear_float_bytes / linear_bytes >= MIN_SAVING[name]
    # the model's resident bytes: the float model's with its block linears (oneDNN-packed, maybe
    # with a one-row copy) replaced by exactly the quantized linears' bytes; nothing else resident
    assert quant_bytes == float_bytes - float_block_bytes + linear_bytes


def test_quantized_model_parallel_matches_single_process(tmp_path, tiny_model_args):
    """int4 groups of 32 columns fall inside each rank's shard (the feed-forward width is a multiple
    of 64 here), so each rank quantizes exactly the values MP=1 does. (Per-row int8 / fp8 scales
    are per rank's row slice under MP, as meta-reference quantizes: close to MP=1, not equal.)"""
    checkpoint = write_random_checkpoint(tmp_path, dataclasses.replace(tiny_model_args, multiple_of=64), seed=8)
    prompts = random_prompts(256, PROMPT_LENGTHS, seed=7)
    alone, _, _ = _run(checkpoint, prompts, quantization="int4_mixed")
    split, _, _ = _run(checkpoint, prompts, quantization="int4_mixed", mp_size=2)
    for seq_id, (logits, tokens) in alone.items():
        assert split[seq_id][1] == tokens
        torch.testing.assert_close(split[seq_id][0], logits, atol=1e-4, rtol=1e-4)


def test_no_kernels_on_the_device_fails_listing_what_works():
    check_quantization("int8", "cpu")
    # CUDA of unknown capability (torch without CUDA) or below 8.0: no int4 kernel (tinygemm)
    with pytest.raises(InvalidRequest, match=r"'int4_mixed': int4 weights have no kernels on cuda; what works there: fp8_mixed, int8, Q4_K \(GGUF\), Q5_K \(GGUF\), Q6_K \(GGUF\); on cpu: fp8_mixed, int4_mixed, int8, Q4_K"):
        check_quantization("int4_mixed", "cuda")
    with pytest.raises(InvalidRequest, match=r"no kernels on cuda \(compute capability 7.5\)"):
        check_quantization("int4_mixed", "cuda", (7, 5))
    check_quantization("int4_mixed", "cuda", (8, 0))
    check_quantization("fp8_mixed", "cuda", (7, 5))  # weight-only fallback below 9.0
    with pytest.raises(InvalidRequest, match=r"'int8': int8 weights have no kernels on mps"):
        check_quantization("int8", "mps")
    with pytest.raises(InvalidRequest, match="unknown quantization 'int3'; supported: fp8_mixed, int4_mixed, int8"):
        check_quantization("int3", "cpu")
