"""The paged, batched forward pass against a plain one-sequence, no-cache reference.

float64 makes the comparison exact to ~1e-10, so any layout slip (a wrong slot, a block read from
another sequence, an off-by-one causal mask) shows up; float32 is checked against the same
reference within a float32 tolerance.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
import torch.nn.functional as F

from engine.loading.checkpoint import load_rank_state_dict, resolve_checkpoint, write_random_checkpoint
from engine.models.args import ModelArgs
from engine.config import EngineConfig
from engine.executor.worker_group import WorkerGroup
from engine.models.llama import precompute_freqs_cis
from engine.backends.cpu import PackedCpuLinear
from engine.backends.cpu import packing_available as cpu_packing_available
from engine.quant.formats import FP8_DTYPE
from engine.quant.linear import QuantLinear
from engine.executor.executor import build_step_inputs
from engine.core.sequence import ScheduledBatch, Sequence
from engine.executor.step_inputs import StepInputs
from engine.types import InvalidRequest, SamplingParams
from tests.conftest import TINY_DESCRIPTOR

BLOCK_SIZE = 4


# --------------------------------------------------------------------------- an independent reference
def reference_logits(state: dict[str, torch.Tensor], args: ModelArgs, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float64 logits of one sequence, no cache: the textbook Llama maths."""
    sd = {k: v.double() for k, v in state.items()}
    n, hd, n_rep = len(tokens), args.head_dim, args.n_heads // args.kv_heads

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + args.norm_eps) * w

    def rope(x):
        freqs = precompute_freqs_cis(
            hd, n, args.rope_theta, args.use_scaled_rope, scale_factor=args.rope_scaling_factor or 8.0, dtype=torch.float64
        )
        c = torch.view_as_complex(x.reshape(n, x.shape[1], hd // 2, 2)) * freqs[:, None, :]
        return torch.view_as_real(c).reshape(x.shape)

    x = sd["tok_embeddings.weight"][torch.tensor(tokens)]
    causal = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        h = rms(x, sd[p + "attention_norm.weight"])
        q = rope((h @ sd[p + "attention.wq.weight"].T).view(n, args.n_heads, hd))
        k = rope((h @ sd[p + "attention.wk.weight"].T).view(n, args.kv_heads, hd)).repeat_interleave(n_rep, dim=1)
        v = (h @ sd[p + "attention.wv.weight"].T).view(n, args.kv_heads, hd).repeat_interleave(n_rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + causal
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        x = x + out @ sd[p + "attention.wo.weight"].T
        h = rms(x, sd[p + "ffn_norm.weight"])
        x = x + (F.silu(h @ sd[p + "feed_forward.w1.weight"].T) * (h @ sd[p + "feed_forward.w3.weight"].T)) @ sd[
            p + "feed_forward.w2.weight"
        ].T
    out_w = sd.get("output.weight", sd["tok_embeddings.weight"])
    return rms(x, sd["norm.weight"]) @ out_w.T


# --------------------------------------------------------------------------- driving the executor
class BlockAllocator:
    """Hands out block ids in a shuffled order so neighbouring sequences never get adjacent blocks."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BLOCK_SIZE < num_tokens:
            seq.block_table.append(self.free.pop())


def all_rows_inputs(batch: ScheduledBatch) -> StepInputs:
    """StepInputs asking for every row's logits, not only the sampling rows."""
    inputs, _ = build_step_inputs(batch, BLOCK_SIZE)
    return dataclasses.replace(inputs, logits_indices=torch.arange(inputs.num_tokens))


def run_random_schedule(executor, prompts: list[list[int]], *, seed: int, max_new: int = 5) -> dict[int, torch.Tensor]:
    """Feed each sequence's tokens through the executor in random-size chunks, several sequences
    per step (prefill chunks and decodes mixed). Returns each sequence's per-position logits."""
    rng = random.Random(seed)
    alloc = BlockAllocator(executor.num_blocks, seed)
    params = SamplingParams(temperature=0.0)
    seqs = [Sequence(i, f"r{i}", list(p), len(p), params) for i, p in enumerate(prompts)]
    got: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
    pending = list(seqs)
    while pending:
        step = rng.sample(pending, k=rng.randint(1, len(pending)))
        counts = [rng.choice([1, 1, 2, 3, s.num_uncomputed_tokens]) for s in step]
        counts = [min(c, s.num_uncomputed_tokens) for c, s in zip(counts, step)]
        for s, c in zip(step, counts):
            alloc.grow(s, s.num_computed_tokens + c)
        batch = ScheduledBatch(step, counts)
        logits = executor.execute(all_rows_inputs(batch))
        row = 0
        for s, c in zip(step, counts):
            got[s.seq_id].append(logits[row : row + c])
            row += c
            s.num_computed_tokens += c
            if s.num_computed_tokens == s.num_tokens:
                if s.num_output_tokens < max_new:  # "generate" greedily: the token is part of the test
                    s.token_ids.append(int(logits[row - 1].argmax()))
                else:
                    pending.remove(s)
    return {seq.seq_id: (torch.cat(got[seq.seq_id]), seq.token_ids) for seq in seqs}


def make_executor(checkpoint, *, dtype="float64", mp_size=1, quantization=None, **kw) -> WorkerGroup:
    spec = resolve_checkpoint(checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    config = EngineConfig(
        dtype=dtype, model_parallel_size=mp_size, block_size_tokens=BLOCK_SIZE, max_batch_size=8,
        quantization=quantization, kv_cache_bytes=kw.pop("kv_cache_bytes", None), **kw,
    )  # fmt: skip
    return WorkerGroup(spec, config, max_seq_len=64)


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def full_state(tiny_checkpoint):
    spec = resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    return {k: v.clone() for k, v in load_rank_state_dict(spec, 0, 1).items()}, spec.model_args


@pytest.fixture(scope="module")
def executor64(tiny_checkpoint):
    executor = make_executor(tiny_checkpoint)
    yield executor
    executor.shutdown()


# --------------------------------------------------------------------------- tests
def test_single_prefill_matches_reference(executor64, full_state):
    state, args = full_state
    prompt = random_prompts(args.vocab_size, [13], seed=1)[0]
    seq = Sequence(0, "r", prompt, len(prompt), SamplingParams())
    BlockAllocator(executor64.num_blocks, 0).grow(seq, len(prompt))
    logits = executor64.execute(all_rows_inputs(ScheduledBatch([seq], [len(prompt)])))
    assert logits.dtype == torch.float64 and logits.shape == (13, args.vocab_size)
    torch.testing.assert_close(logits.double(), reference_logits(state, args, prompt), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batch_matches_reference(executor64, full_state, seed):
    state, args = full_state
    prompts = random_prompts(args.vocab_size, [1, 2, 5, 9, 14, 23], seed=seed)
    results = run_random_schedule(executor64, prompts, seed=seed)
    for logits, tokens in results.values():
        ref = reference_logits(state, args, tokens[: logits.shape[0]])
        torch.testing.assert_close(logits.double(), ref, atol=1e-6, rtol=1e-6)
        # every generated token is the reference's greedy choice
        assert tokens[len(ref) - 4 :] == [int(t) for t in ref.argmax(-1)[len(ref) - 5 : -1]]


def test_prefix_already_in_cache(executor64, full_state):
    """Sequence B shares A's first two blocks (a prefix-cache hit) and computes only its tail."""
    state, args = full_state
    shared, tail = random_prompts(args.vocab_size, [8, 5], seed=7)
    alloc = BlockAllocator(executor64.num_blocks, 3)
    a = Sequence(0, "a", list(shared), 8, SamplingParams())
    alloc.grow(a, 8)
    executor64.execute(all_rows_inputs(ScheduledBatch([a], [8])))
    b = Sequence(1, "b", shared + tail, 13, SamplingParams(), num_computed_tokens=8, block_table=list(a.block_table))
    alloc.grow(b, 13)
    logits = executor64.execute(all_rows_inputs(ScheduledBatch([b], [5])))
    torch.testing.assert_close(logits.double(), reference_logits(state, args, shared + tail)[8:], atol=1e-6, rtol=1e-6)


def test_float32_close_to_reference(tiny_checkpoint, full_state):
    state, args = full_state
    executor = make_executor(tiny_checkpoint, dtype="float32")
    try:
        packed = [m for m in executor._shard.model.modules() if isinstance(m, PackedCpuLinear)]
        assert len(packed) == (4 * args.n_layers + 1 if cpu_packing_available(torch.float32) else 0)
        results = run_random_schedule(executor, random_prompts(args.vocab_size, [3, 11, 17], seed=5), seed=5, max_new=2)
    finally:
        executor.shutdown()
    for logits, tokens in results.values():
        ref = reference_logits(state, args, tokens[: logits.shape[0]])
        torch.testing.assert_close(logits.double(), ref, atol=2e-4, rtol=2e-4)


def test_bfloat16_close_to_reference(tiny_checkpoint, full_state):
    state, args = full_state
    executor = make_executor(tiny_checkpoint, dtype="bfloat16")
    try:
        results = run_random_schedule(executor, random_prompts(args.vocab_size, [4, 12], seed=8), seed=8, max_new=2)
    finally:
        executor.shutdown()
    for logits, tokens in results.values():
        assert logits.dtype == torch.float32  # the head's float32 sums, not rounded to the model dtype
        ref = reference_logits(state, args, tokens[: logits.shape[0]]).float()
        assert F.cosine_similarity(logits.float(), ref, dim=-1).min() > 0.99


def test_matches_llama_models_reference(full_state):
    """Fidelity: Meta's own llama3 reference Transformer (llama-models) on the same weights."""
    reference = pytest.importorskip("llama_models.llama3.model")
    from llama_models.llama3.args import ModelArgs as MetaArgs

    from engine.executor.parallel import destroy_group, init_group

    state, args = full_state
    args = dataclasses.replace(args, rope_scaling_factor=None)  # the reference hard-codes Llama 3.1's 8
    prompt = random_prompts(args.vocab_size, [12], seed=11)[0]
    init_group(torch.device("cpu"), rank=0, world_size=1, init_method="tcp://127.0.0.1:0", timeout_s=60)
    try:
        meta_args = MetaArgs(**{k: v for k, v in args.to_params().items()}, max_batch_size=1, max_seq_len=32)
        model = reference.Transformer(meta_args)
        model.load_state_dict(state, strict=True)
        expected = model(torch.tensor([prompt]), 0)[0]
    finally:
        destroy_group()
    ours = reference_logits(state, args, prompt)
    torch.testing.assert_close(ours.float(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling(factor):
    """The "llama3" RoPE scaling as HF's config.json states it (factor 8: 3.1/3.3, 32: 3.2 1B/3B)."""
    head_dim, theta, low, high, old_len = 64, 500000.0, 1.0, 4.0, 8192
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    expected = torch.where(
        wavelen > old_len / low,
        inv / factor,
        torch.where(wavelen < old_len / high, inv, (1 - smooth) * inv / factor + smooth * inv),
    )
    table = precompute_freqs_cis(head_dim, 2, theta, True, scale_factor=factor, dtype=torch.float64)
    torch.testing.assert_close(torch.angle(table[1]), expected)


def test_logits_only_for_requested_rows(executor64, full_state):
    state, args = full_state
    prompts = random_prompts(args.vocab_size, [6, 4], seed=9)
    alloc = BlockAllocator(executor64.num_blocks, 9)
    seqs = [Sequence(i, f"r{i}", p, len(p), SamplingParams()) for i, p in enumerate(prompts)]
    for s in seqs:
        alloc.grow(s, s.num_tokens)
    inputs, sampling = build_step_inputs(ScheduledBatch(seqs, [6, 4]), BLOCK_SIZE)
    logits = executor64.execute(inputs)
    assert sampling == [0, 1] and logits.shape == (2, args.vocab_size)
    for row, p in zip(logits, prompts):
        torch.testing.assert_close(row.double(), reference_logits(state, args, p)[-1], atol=1e-6, rtol=1e-6)


def test_fp8_mixed_quantization(tiny_checkpoint, full_state):
    state, args = full_state
    executor = make_executor(tiny_checkpoint, dtype="float32", quantization="fp8_mixed")
    try:
        linears = [m for m in executor._shard.model.modules() if isinstance(m, QuantLinear)]
        # every transformer linear (wq|wk|wv, wo, w1|w3, w2, fused at load), not the output head ("mixed")
        assert len(linears) == 4 * args.n_layers and all(m.weight_q.qweight.dtype == FP8_DTYPE for m in linears)
        assert not isinstance(executor._shard.model.output, QuantLinear)
        prompt = random_prompts(args.vocab_size, [10], seed=2)[0]
        results = run_random_schedule(executor, [prompt], seed=2, max_new=1)
    finally:
        executor.shutdown()
    logits, tokens = results[0]
    ref = reference_logits(state, args, tokens[: logits.shape[0]]).float()
    cos = F.cosine_similarity(logits, ref, dim=-1)
    assert cos.min() > 0.99  # float8 weights: close, not equal


def test_unknown_quantization_is_refused(tiny_checkpoint):
    with pytest.raises(InvalidRequest, match="unknown quantization 'int3'.*fp8_mixed"):
        make_executor(tiny_checkpoint, quantization="int3")


def test_tied_embeddings_and_kv_budget(tmp_path, tiny_model_args):
    args = dataclasses.replace(tiny_model_args, tie_word_embeddings=True)
    write_random_checkpoint(tmp_path, args, seed=3)
    spec = resolve_checkpoint(tmp_path, model_id="tied", llama_model=TINY_DESCRIPTOR)
    args = spec.model_args
    state = {k: v.clone() for k, v in load_rank_state_dict(spec, 0, 1).items()}
    assert "output.weight" not in state
    block_bytes = 2 * args.n_layers * BLOCK_SIZE * args.kv_heads * args.head_dim * 8
    executor = make_executor(tmp_path, kv_cache_bytes=10 * block_bytes)
    try:
        assert executor.num_blocks == 10 and executor.kv_cache_bytes == 10 * block_bytes
        prompt = random_prompts(args.vocab_size, [7], seed=4)[0]
        logits, tokens = run_random_schedule(executor, [prompt], seed=4, max_new=1)[0]
    finally:
        executor.shutdown()
    torch.testing.assert_close(logits.double(), reference_logits(state, args, tokens[: logits.shape[0]]), atol=1e-6, rtol=1e-6)


def test_kv_cache_never_larger_than_a_full_batch_needs(tiny_checkpoint):
    executor = make_executor(tiny_checkpoint, kv_cache_bytes=1 << 30)
    try:
        assert executor.num_blocks == 8 * math.ceil(64 / BLOCK_SIZE)  # max_batch_size * blocks per sequence
        assert executor.vocab_size == 256 and executor.block_size == BLOCK_SIZE and executor.weight_bytes > 0
    finally:
        executor.shutdown()
