"""Llama 4 through the paged, batched forward against llama-models' own llama4 reference.

The reference runs every test prompt as one prefill from position 0 (its decode path ignores the
chunk mask, so it is not used); our logits come from random mixed schedules of prefill chunks and
decodes, so chunked attention, NoPE layers, qk-norm, temperature tuning and MoE routing are all
checked at every position, including decodes. The reference rotates and qk-normalises in float32
whatever its dtype, hence the 1e-4 tolerance against it; our own batched-vs-alone check is float64.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from engine.loading.checkpoint import resolve_checkpoint
from engine.config import EngineConfig
from engine.executor.worker_group import WorkerGroup
from engine.models.llama4.model import Llama4Transformer, MoEFeedForward
from engine.quant.formats import Fp8Weight
from engine.quant.linear import QuantLinear
from engine.core.sequence import ScheduledBatch, Sequence
from engine.types import SamplingParams
from tests.engine.test_model import BLOCK_SIZE, BlockAllocator, all_rows_inputs, random_prompts, run_random_schedule
from tests.llama4_fixtures import TINY_LLAMA4_DESCRIPTOR, write_tiny_llama4_checkpoint

PROMPT_LENGTHS = [1, 3, 9, 14, 21]  # chunk size 8: most prompts span several chunks


def make_executor(checkpoint, *, dtype="float64", mp_size=1, quantization=None, cpu_kernels=True) -> WorkerGroup:
    spec = resolve_checkpoint(checkpoint, model_id="tiny-llama4", llama_model=TINY_LLAMA4_DESCRIPTOR)
    config = EngineConfig(
        dtype=dtype, model_parallel_size=mp_size, block_size_tokens=BLOCK_SIZE, max_batch_size=8,
        quantization=quantization, cpu_kernels=cpu_kernels,
    )  # fmt: skip
    return WorkerGroup(spec, config, max_seq_len=64)


@contextlib.contextmanager
def executor_of(checkpoint, **kw):
    executor = make_executor(checkpoint, **kw)
    try:
        yield executor
    finally:
        executor.shutdown()


@pytest.fixture(scope="module")
def llama4_checkpoint(tmp_path_factory):
    return write_tiny_llama4_checkpoint(tmp_path_factory.mktemp("llama4_1shard"))


@pytest.fixture(scope="module")
def meta_reference(llama4_checkpoint):
    """prompt -> [len, vocab] float64 logits from llama-models' llama4 Transformer, loaded from the
    shipped checkpoint through its own load hooks (fairscale group of one, .cuda() as identity)."""
    reference = pytest.importorskip("llama_models.llama4.model")
    from llama_models.llama4.args import ModelArgs as MetaArgs
    from llama_models.llama4.datatypes import TransformerInput

    from engine.executor.parallel import destroy_group, init_group

    params = resolve_checkpoint(llama4_checkpoint, model_id="r", llama_model=TINY_LLAMA4_DESCRIPTOR).model_args.to_params()
    state = torch.load(llama4_checkpoint / "consolidated.00.pth", weights_only=True)
    init_group(torch.device("cpu"), rank=0, world_size=1, init_method="tcp://127.0.0.1:0", timeout_s=60)
    default_dtype, cuda = torch.get_default_dtype(), torch.Tensor.cuda
    torch.set_default_dtype(torch.float64)
    torch.Tensor.cuda = lambda self, *a, **k: self  # the reference's KV caches call .cuda()
    try:
        model = reference.Transformer(MetaArgs(**params, max_batch_size=1, max_seq_len=64))
        missing, unexpected = model.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
        assert not unexpected and all("cache" not in k for k in missing) and not missing, (missing, unexpected)

        def logits(prompt: list[int]) -> torch.Tensor:
            out = model(TransformerInput(tokens=torch.tensor([prompt]), tokens_position=0))
            return out.logits[0].double()

        yield logits
    finally:
        torch.Tensor.cuda = cuda
        torch.set_default_dtype(default_dtype)
        destroy_group()


def schedule_matches(results, reference, *, atol: float) -> None:
    for logits, tokens in results.values():
        expected = reference(tokens[: logits.shape[0]])
        torch.testing.assert_close(logits.double(), expected, atol=atol, rtol=atol)


def test_model_is_llama4_with_every_feature(llama4_checkpoint):
    with executor_of(llama4_checkpoint) as executor:
        model = executor._shard.model
        assert isinstance(model, Llama4Transformer)
        assert [isinstance(layer.feed_forward, MoEFeedForward) for layer in model.layers] == [False, True, False, True]
        assert [layer.attention.use_rope for layer in model.layers] == [True, True, False, True]
        assert [layer.chunked for layer in model.layers] == [True, True, False, True]


@pytest.mark.parametrize("seed", [0, 1])
def test_float64_mixed_batches_match_meta_reference(llama4_checkpoint, meta_reference, seed):
    prompts = random_prompts(256, PROMPT_LENGTHS, seed=seed)
    with executor_of(llama4_checkpoint) as executor:
        results = run_random_schedule(executor, prompts, seed=seed, max_new=6)
    schedule_matches(results, meta_reference, atol=1e-4)


def test_batched_equals_alone_float64(llama4_checkpoint):
    """Every sequence's logits in a random mixed schedule == its own single prefill (exact maths)."""
    prompts = random_prompts(256, PROMPT_LENGTHS, seed=3)
    with executor_of(llama4_checkpoint) as executor:
        results = run_random_schedule(executor, prompts, seed=3, max_new=6)
        for logits, tokens in results.values():
            alone = prefill_logits(executor, tokens[: logits.shape[0]])
            torch.testing.assert_close(logits.double(), alone.double(), atol=1e-9, rtol=1e-9)


def prefill_logits(executor, tokens: list[int]) -> torch.Tensor:
    seq = Sequence(99, "alone", list(tokens), len(tokens), SamplingParams())
    BlockAllocator(executor.num_blocks, 0).grow(seq, len(tokens))
    return executor.execute(all_rows_inputs(ScheduledBatch([seq], [len(tokens)])))


def test_prefix_cache_hit_uses_chunked_windows(llama4_checkpoint, meta_reference):
    """B reuses A's first 12 tokens' blocks (12 > the chunk size 8) and computes only its tail."""
    shared, tail = random_prompts(256, [12, 7], seed=7)
    with executor_of(llama4_checkpoint) as executor:
        alloc = BlockAllocator(executor.num_blocks, 3)
        a = Sequence(0, "a", list(shared), 12, SamplingParams())
        alloc.grow(a, 12)
        executor.execute(all_rows_inputs(ScheduledBatch([a], [12])))
        b = Sequence(1, "b", shared + tail, 19, SamplingParams(), num_computed_tokens=12, block_table=list(a.block_table))
        alloc.grow(b, 19)
        logits = executor.execute(all_rows_inputs(ScheduledBatch([b], [7])))
    torch.testing.assert_close(logits.double(), meta_reference(shared + tail)[12:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_float32_cpu_backends_match_reference(llama4_checkpoint, meta_reference, cpu_kernels):
    """chunk 8 over blocks of 4: the C kernel's decode reads each sequence's chunk window in place."""
    prompts = random_prompts(256, [5, 13, 19], seed=5)
    with executor_of(llama4_checkpoint, dtype="float32", cpu_kernels=cpu_kernels) as executor:
        results = run_random_schedule(executor, prompts, seed=5, max_new=6)
    schedule_matches(results, meta_reference, atol=2e-4)


def test_chunk_not_a_multiple_of_the_block_falls_back_to_torch(tmp_path):
    """chunk 6 over blocks of 4: the kernel backend hands chunked layers to torch's masks."""
    ckpt = write_tiny_llama4_checkpoint(tmp_path, attention_chunk_size=6)
    prompts = random_prompts(256, [4, 11, 17], seed=6)
    with executor_of(ckpt, dtype="float32") as fast, executor_of(ckpt, dtype="float64") as exact:
        got = run_random_schedule(fast, prompts, seed=6, max_new=4)
        for logits, tokens in got.values():
            expected = prefill_logits(exact, tokens[: logits.shape[0]])
            torch.testing.assert_close(logits.double(), expected.double(), atol=2e-4, rtol=2e-4)


def test_fp8_mixed_quantizes_the_experts(llama4_checkpoint, meta_reference):
    prompts = random_prompts(256, [10], seed=4)
    with executor_of(llama4_checkpoint, dtype="bfloat16", quantization="fp8_mixed") as executor:
        moe = executor._shard.model.layers[1].feed_forward
        experts = [getattr(w, "local", w) for w in (*moe.experts_w13, *moe.experts_w2)]
        assert all(isinstance(w, QuantLinear) and isinstance(w.weight_q, Fp8Weight) for w in experts)
        logits = prefill_logits(executor, prompts[0])
    assert F.cosine_similarity(logits.double(), meta_reference(prompts[0]), dim=-1).min() > 0.98
