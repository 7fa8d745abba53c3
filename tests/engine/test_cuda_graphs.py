"""CUDA-graph decode's bookkeeping (engine/executor/cuda_graphs.py) on the CPU, with the capture
replaced by eager execution (the replay runs the model over the static buffers again): the sizes
captured and chosen, padded steps equal to unpadded ones on the real rows, padding rows writing
only the scratch block, the buffers' padding reset when a batch shrinks, and the steps that must
run eagerly. The graphs themselves (greedy equality at every captured size, memory) are checked on
a GPU (tests/engine/test_cuda.py, .ci/cuda)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.core.sequence import ScheduledBatch, Sequence
from engine.executor.cuda_graphs import DecodeGraphs, capture_sizes, padded_size, planned_graph_bytes
from engine.executor.executor import build_step_inputs
from engine.executor.worker import Worker
from engine.loading.checkpoint import resolve_checkpoint
from engine.types import SamplingParams
from tests.conftest import TINY_DESCRIPTOR
from tests.engine.test_model import BLOCK_SIZE, BlockAllocator, random_prompts

NUM_BLOCKS = 48  # the block pool's; block NUM_BLOCKS is the graphs' scratch block
MAX_SEQ_LEN = 64
SIZES = [1, 2, 4, 8]


def test_capture_sizes_and_padding():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert capture_sizes(5) == [1, 2, 4, 5]  # max_batch_size itself, never more
    assert capture_sizes(1) == [1]
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert capture_sizes(100)[-3:] == [80, 96, 100]
    sizes = capture_sizes(64)
    assert [padded_size(sizes, n) for n in (1, 2, 3, 5, 8, 9, 17, 25, 33, 49, 64, 65)] == [1, 2, 4, 8, 8, 16, 24, 32, 48, 64, 64, None]


def test_graph_memory_is_planned_on_cuda_only(tiny_model_args):
    cuda = EngineConfig(device="cuda", max_batch_size=8, block_size_tokens=BLOCK_SIZE)
    assert planned_graph_bytes(tiny_model_args, cuda, torch.bfloat16) > 0
    for config in (EngineConfig(device="cpu"), dataclasses.replace(cuda, cuda_graphs=False), dataclasses.replace(cuda, model_parallel_size=2)):
        assert planned_graph_bytes(tiny_model_args, config, torch.bfloat16) == 0
    # more rows captured, more activations held
    assert planned_graph_bytes(tiny_model_args, dataclasses.replace(cuda, max_batch_size=64), torch.bfloat16) > planned_graph_bytes(tiny_model_args, cuda, torch.bfloat16)


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    spec = resolve_checkpoint(tiny_checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    config = EngineConfig(dtype="float64", block_size_tokens=BLOCK_SIZE, max_batch_size=8)
    worker = Worker.load(spec, config, rank=0, device=torch.device("cpu"), max_seq_len=MAX_SEQ_LEN)
    worker.allocate_kv_cache(NUM_BLOCKS + 1)  # as Worker does with graphs on: one scratch block past the pool's
    return worker


def eager_graphs(worker: Worker, captured: list[int]) -> DecodeGraphs:
    def capture(step):
        captured.append(step)
        return step  # the "replay" runs the model again over the static buffers

    return DecodeGraphs(lambda inputs: worker.model(inputs, worker.kv_caches), sizes=SIZES,
                        max_blocks_per_seq=MAX_SEQ_LEN // BLOCK_SIZE, scratch_block=NUM_BLOCKS, block_size=BLOCK_SIZE,
                        device=torch.device("cpu"), capture=capture)  # fmt: skip


def snapshot(worker: Worker) -> list[torch.Tensor]:
    return [t.clone() for layer in worker.kv_caches for t in layer]


def restore(worker: Worker, saved: list[torch.Tensor]) -> None:
    for t, s in zip((t for layer in worker.kv_caches for t in layer), saved):
        t.copy_(s)


def eager_and_padded(worker: Worker, graphs: DecodeGraphs, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's logits run eagerly and through the graphs (Worker.forward both times), from the
    same cache; asserts the two runs leave every block but the scratch one equal."""
    before = snapshot(worker)
    worker.decode_graphs = None
    eager = worker.forward(inputs)
    after_eager = snapshot(worker)
    restore(worker, before)
    worker.decode_graphs = graphs
    try:
        padded = worker.forward(inputs)
    finally:
        worker.decode_graphs = None
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[inputs.slot_mapping] = True
    for e, p in zip(after_eager, snapshot(worker)):  # [blocks, block_size, kv_heads, head_dim]
        e, p = e[:NUM_BLOCKS].flatten(0, 1), p[:NUM_BLOCKS].flatten(0, 1)  # every real slot
        assert torch.equal(e[~written], p[~written]), "a padding row wrote a real block"
        # the step's own K/V, computed in a batch of another size: equal up to the order of float64 sums
        torch.testing.assert_close(p[written], e[written], rtol=1e-12, atol=1e-12)
    return eager, padded


def test_padded_decode_steps_equal_unpadded_ones_and_touch_only_the_scratch_block(worker, tiny_model_args):
    captured: list = []
    graphs = eager_graphs(worker, captured)
    assert len(captured) == len(SIZES)
    alloc = BlockAllocator(NUM_BLOCKS, seed=3)
    params = SamplingParams(temperature=0.0)
    prompts = random_prompts(tiny_model_args.vocab_size, [5, 9, 3, 12, 7, 4, 6], seed=11)
    seqs = [Sequence(i, f"r{i}", list(p), len(p), params) for i, p in enumerate(prompts)]
    for seq in seqs:  # prompts prefilled eagerly (graphs never run a prefill)
        alloc.grow(seq, seq.num_tokens)
    worker.forward(build_step_inputs(ScheduledBatch(seqs, [s.num_tokens for s in seqs]), BLOCK_SIZE)[0])
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens
    scratch_before = [t[NUM_BLOCKS].clone() for layer in worker.kv_caches for t in layer]
    # batches of 7 (padded to 8), 5 (8), 3 (4: rows of the 8-row step become padding again), 2, 1;
    # the growing sequences cross block boundaries on the way
    for running in (seqs, seqs, seqs[:5], seqs[2:5], seqs[3:5], seqs[4:5], seqs[:7]):
        for seq in running:
            seq.token_ids.append(len(seq.token_ids) % tiny_model_args.vocab_size)
            alloc.grow(seq, seq.num_tokens)
        inputs, sampling = build_step_inputs(ScheduledBatch(running, [1] * len(running)), BLOCK_SIZE)
        assert graphs.size_for(inputs) == padded_size(SIZES, len(running))
        eager, padded = eager_and_padded(worker, graphs, inputs)
        assert padded.shape == eager.shape == (len(sampling), tiny_model_args.vocab_size)
        torch.testing.assert_close(padded, eager, rtol=1e-12, atol=1e-12)
        assert torch.equal(padded.argmax(-1), eager.argmax(-1))
        size = graphs.size_for(inputs)
        view = graphs.inputs_of(size)
        n = len(running)
        assert view.slot_mapping[n:].tolist() == [graphs.scratch_slot] * (size - n)
        assert view.block_tables[n:, 0].tolist() == [NUM_BLOCKS] * (size - n)
        assert view.seq_lens[n:].tolist() == [1] * (size - n)
        assert torch.equal(view.slot_mapping[:n], inputs.slot_mapping) and torch.equal(view.seq_lens[:n], inputs.seq_lens)
        for seq in running:
            seq.num_computed_tokens += 1
    scratch_after = [t[NUM_BLOCKS] for layer in worker.kv_caches for t in layer]
    assert any(not torch.equal(a, b) for a, b in zip(scratch_before, scratch_after)), "padding rows wrote nothing"
    assert graphs.scratch_slot == NUM_BLOCKS * BLOCK_SIZE


def test_logits_rows_asked_for_in_their_order(worker, tiny_model_args):
    """Only some rows sample (a 1-token chunk mid-prompt does not), or rows come in another order:
    the graph's rows are picked by the step's logits_indices."""
    graphs = eager_graphs(worker, [])
    alloc = BlockAllocator(NUM_BLOCKS, seed=5)
    seqs = [Sequence(i, f"s{i}", p, len(p), SamplingParams(temperature=0.0))
            for i, p in enumerate(random_prompts(tiny_model_args.vocab_size, [4, 6, 3], seed=2))]  # fmt: skip
    for seq in seqs:
        alloc.grow(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1  # one token left each: a "decode" of the last prompt token
    inputs, _ = build_step_inputs(ScheduledBatch(seqs, [1, 1, 1]), BLOCK_SIZE)
    inputs = dataclasses.replace(inputs, logits_indices=torch.tensor([2, 0], dtype=torch.int64))
    eager, padded = eager_and_padded(worker, graphs, inputs)
    assert padded.shape[0] == 2
    torch.testing.assert_close(padded, eager, rtol=1e-12, atol=1e-12)


def test_steps_that_run_eagerly(worker, tiny_model_args):
    graphs = eager_graphs(worker, [])
    alloc = BlockAllocator(NUM_BLOCKS, seed=7)
    seqs = [Sequence(i, f"e{i}", p, len(p), SamplingParams(temperature=0.0))
            for i, p in enumerate(random_prompts(tiny_model_args.vocab_size, [5, 3] + [2] * 8, seed=4))]  # fmt: skip
    for seq in seqs:
        alloc.grow(seq, seq.num_tokens)
    mixed, _ = build_step_inputs(ScheduledBatch(seqs[:2], [5, 1]), BLOCK_SIZE)  # a prefill chunk beside a decode
    assert graphs.size_for(mixed) is None and graphs.run(mixed) is None
    too_many, _ = build_step_inputs(ScheduledBatch(seqs[:9], [1] * 9), BLOCK_SIZE)  # more than the largest capture
    assert graphs.size_for(too_many) is None
    decode, _ = build_step_inputs(ScheduledBatch(seqs[:3], [1] * 3), BLOCK_SIZE)
    assert graphs.size_for(decode) == 4
    assert graphs.size_for(dataclasses.replace(decode, lora_ids=torch.tensor([0, 1, 0]))) is None  # adapters wrap the per-op linears
    assert graphs.size_for(dataclasses.replace(decode, image_rows=torch.tensor([0]))) is None
    wide = dataclasses.replace(decode, block_tables=torch.zeros(3, MAX_SEQ_LEN // BLOCK_SIZE + 1, dtype=torch.int32))
    assert graphs.size_for(wide) is None


# --------------------------------------------------------------------------- on a GPU (.ci/cuda)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
GPU_MAX_BATCH = 32  # captured: 1, 2, 4, 8, 16, 24, 32
GPU_KV_CACHE_BYTES = 64 << 20


def gpu_executor(checkpoint, **config):
    from engine.executor.worker_group import WorkerGroup

    spec = resolve_checkpoint(checkpoint, model_id="tiny", llama_model=TINY_DESCRIPTOR)
    config = EngineConfig(device="cuda", block_size_tokens=BLOCK_SIZE, max_batch_size=GPU_MAX_BATCH,
                          kv_cache_bytes=GPU_KV_CACHE_BYTES, **config)  # fmt: skip
    return WorkerGroup(spec, config, max_seq_len=MAX_SEQ_LEN)


def teacher_forced_decodes(executor, prompts: list[list[int]], tokens: list[list[int]] | None, steps: int):
    """Prefill the prompts in one step, then `steps` pure-decode steps of every sequence; each
    decode feeds `tokens[i][step]` (teacher forcing) or, with tokens None, the greedy token. Returns
    the fed tokens and each decode step's float32 logits [sequences, vocab] (on the CPU)."""
    alloc = BlockAllocator(executor.num_blocks, seed=len(prompts))
    seqs = [Sequence(i, f"g{i}", list(p), len(p), SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]
    for seq in seqs:
        alloc.grow(seq, seq.num_tokens)
    logits = executor.execute(build_step_inputs(ScheduledBatch(seqs, [s.num_tokens for s in seqs]), BLOCK_SIZE)[0]).float()
    fed = [[] for _ in seqs] if tokens is None else tokens
    per_step = []
    for step in range(steps):
        for i, seq in enumerate(seqs):
            seq.num_computed_tokens = seq.num_tokens
            if tokens is None:
                fed[i].append(int(logits[i].argmax()))
            seq.token_ids.append(fed[i][step])
            alloc.grow(seq, seq.num_tokens)
        logits = executor.execute(build_step_inputs(ScheduledBatch(seqs, [1] * len(seqs)), BLOCK_SIZE)[0]).float()
        per_step.append(logits)
    return fed, per_step


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_equal_eager_decodes_at_every_batch_size(tiny_checkpoint, tiny_model_args, dtype):
    """Graphs on vs off at every batch size 1..32 (the captured ones and those padded up to them):
    greedy tokens equal, the logprobs of every token within the dtype's tolerance. Teacher-forced by
    the eager run's greedy tokens, so a near-tie decided differently by a padded batch's GEMM
    cannot derail the rest; a token must match wherever its margin over the runner-up exceeds the
    tolerance."""
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    eager, graphs = gpu_executor(tiny_checkpoint, dtype=dtype, cuda_graphs=False), gpu_executor(tiny_checkpoint, dtype=dtype)
    assert eager.decode_graph_sizes == [] and graphs.decode_graph_sizes == capture_sizes(GPU_MAX_BATCH)
    try:
        for batch in range(1, GPU_MAX_BATCH + 1):
            prompts = random_prompts(tiny_model_args.vocab_size, [3 + (7 * i) % 13 for i in range(batch)], seed=batch)
            tokens, expected = teacher_forced_decodes(eager, prompts, None, steps=6)
            _, got = teacher_forced_decodes(graphs, prompts, tokens, steps=6)
            for want, have in zip(expected, got):
                want_lp, have_lp = want.log_softmax(-1), have.log_softmax(-1)
                torch.testing.assert_close(have_lp, want_lp, rtol=0, atol=tolerance, msg=f"batch {batch}")
                top2 = want_lp.topk(2, dim=-1).values
                clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance
                assert torch.equal(have.argmax(-1)[clear], want.argmax(-1)[clear]), f"batch {batch}: greedy tokens differ"
    finally:
        eager.shutdown()
        graphs.shutdown()


@needs_cuda
def test_graphs_are_captured_and_unloading_returns_their_memory(tiny_checkpoint):
    """Loading captures one graph per size; load/unload cycles come back to the same allocated
    memory (the graphs, their pool and the scratch block freed with the model)."""
    import gc

    def cycle() -> int:
        executor = gpu_executor(tiny_checkpoint, dtype="bfloat16")
        try:
            assert executor.decode_graph_sizes == [1, 2, 4, 8, 16, 24, 32]
        finally:
            executor.shutdown()
        del executor
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()

    first = cycle()
    assert [cycle() for _ in range(2)] == [first, first]
