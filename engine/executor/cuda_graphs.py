"""CUDA graphs for decode steps: a pure-decode step replayed from a graph captured at load.

A decode step of a small model on a GPU is launch- and Python-bound (issue #33: the 1.1B model's
batch-1 step took 10.7 ms on an H200 with the GPU busy 3.4 ms, ~360 launches). DecodeGraphs
captures the model's forward once per batch size in `capture_sizes` (1, 2, 4, 8, 16, 24, 32, 48,
64, ... up to max_batch_size) over static input buffers; a pure-decode step (every sequence one new
token, no LoRA rows, no image rows) is padded up to the nearest captured size, its inputs copied
into the buffers, and the graph replayed. Prefill and mixed steps run eagerly.

Padding rows must not touch real KV blocks: each writes its K/V to a scratch slot (the first slot
of a scratch block past the block pool's, never handed out) and attends that one key alone (its
block table's first entry is the scratch block, its K/V length 1); their logits are dropped. A real
row reads its block table only below its K/V length, so the columns past its own table's width are
left as the last step wrote them rather than cleared.

The bookkeeping (sizes, buffers, padding, reading back the real rows) is plain torch over any
device: `capture` is injected, so CPU tests replace capture by eager execution
(tests/engine/test_cuda_graphs.py) and check padded == unpadded and that no real block is written.
Only a backend whose pure-decode step reads no device tensor on the host may be captured
(Backend.captures_decode_steps: the CUDA backend's Triton path).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from engine.executor.step_inputs import StepInputs

log = logging.getLogger(__name__)

Forward = Callable[[StepInputs], torch.Tensor]  # step inputs -> [rows, vocab] logits
Replay = Callable[[], torch.Tensor]  # runs the captured step again; its (static) logits
Capture = Callable[[Callable[[], torch.Tensor]], Replay]


def capture_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 to 32, every 16 to 128, every 32 beyond, and
    max_batch_size itself, so padding adds at most a few rows (at most 1/3 of 24 -> 32, 1/7 from
    there) while the captures stay few (vLLM captures 1, 2, 4 and every 8)."""
    sizes = [1, 2, 4, 8, *range(16, 33, 8), *range(48, 129, 16), *range(160, max_batch_size + 1, 32)]
    return sorted({size for size in sizes if size < max_batch_size} | {max_batch_size})


def padded_size(sizes: Sequence[int], num_rows: int) -> int | None:
    """The smallest captured size holding num_rows rows; None when none does."""
    return min((size for size in sizes if size >= num_rows), default=None)


def is_pure_decode(inputs: StepInputs) -> bool:
    """A step a decode graph can run: one new token per query group (a speculating sequence's draft
    rows are groups of their own: a verify step qualifies), no LoRA rows (the adapters wrap the
    per-op linears) and no image rows."""
    return inputs.num_tokens == inputs.num_seqs and inputs.lora_ids is None and inputs.image_rows is None


def estimate_graph_bytes(*, dim: int, ffn_hidden_dim: int, vocab_size: int, max_rows: int, dtype_bytes: int,
                         head_chunk_rows: int) -> int:  # fmt: skip
    """Memory the captured graphs hold, for the KV budget: one memory pool shared by every capture
    (the largest captured first), whose peak is the largest step's live activations: per row the
    residual stream, norms, q|k|v, attention out and gate|up in the model dtype (an upper bound of
    about 6 x dim + 3 x hidden values), its logits in float32 twice (the head's output and the rows
    read back), plus the float32 head's slab scratch (engine.backends.base.FloatHeadLinear)."""
    per_row = (6 * dim + 3 * ffn_hidden_dim) * dtype_bytes + 2 * vocab_size * 4
    return max_rows * per_row + head_chunk_rows * dim * 4


class DecodeGraphs:
    """Decode steps replayed from graphs captured once per size (see the module docstring)."""

    def __init__(self, forward: Forward, *, sizes: Sequence[int], max_blocks_per_seq: int, scratch_block: int,
                 block_size: int, device: torch.device, capture: Capture) -> None:  # fmt: skip
        self.sizes = sorted(sizes)
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size  # the scratch block's first slot
        self.memory_bytes = 0  # the captures' memory pool, where measured (capture_decode_graphs)
        max_rows = self.sizes[-1]
        ints = dict(dtype=torch.int64, device=device)
        # the static inputs every graph reads, set up as all padding: a capture writes the scratch slot only
        self._input_ids = torch.zeros(max_rows, **ints)
        self._positions = torch.zeros(max_rows, **ints)
        self._slot_mapping = torch.full((max_rows,), self.scratch_slot, **ints)
        self._block_tables = torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._block_tables[:, 0] = scratch_block
        self._seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self._query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # one token per row, for good
        self._logits_indices = torch.arange(max_rows, **ints)  # every row's logits: the real ones are picked after
        self._graphs: dict[int, Replay] = {}
        started_s = time.monotonic()
        for size in reversed(self.sizes):  # the largest first: the smaller ones fit in the memory it pooled
            view = self.inputs_of(size)
            self._graphs[size] = capture(lambda view=view: forward(view))
        self.capture_s = time.monotonic() - started_s

    @property
    def max_blocks_per_seq(self) -> int:
        return int(self._block_tables.shape[1])

    def inputs_of(self, size: int) -> StepInputs:
        """The static buffers' first `size` rows, as the graph of that size reads them."""
        return StepInputs(
            input_ids=self._input_ids[:size], positions=self._positions[:size], slot_mapping=self._slot_mapping[:size],
            block_tables=self._block_tables[:size], query_start_loc=self._query_start_loc[: size + 1],
            seq_lens=self._seq_lens[:size], logits_indices=self._logits_indices[:size],
        )  # fmt: skip

    def size_for(self, inputs: StepInputs) -> int | None:
        """The captured size that runs this step, None when it runs eagerly."""
        if not is_pure_decode(inputs) or inputs.block_tables.shape[1] > self.max_blocks_per_seq:
            return None
        return padded_size(self.sizes, inputs.num_seqs)

    def fill(self, inputs: StepInputs, size: int) -> None:
        """Copy a pure-decode step's inputs (any device: rank 0 builds them on the CPU) into the
        static buffers' first rows and make rows num_seqs..size padding."""
        rows, width = inputs.num_seqs, inputs.block_tables.shape[1]
        self._input_ids[:rows].copy_(inputs.input_ids, non_blocking=True)
        self._positions[:rows].copy_(inputs.positions, non_blocking=True)
        self._slot_mapping[:rows].copy_(inputs.slot_mapping, non_blocking=True)
        self._block_tables[:rows, :width].copy_(inputs.block_tables, non_blocking=True)
        self._seq_lens[:rows].copy_(inputs.seq_lens, non_blocking=True)
        if rows < size:  # padding: token 0 at position 0, written to the scratch slot, attending it alone
            self._input_ids[rows:size] = 0
            self._positions[rows:size] = 0
            self._slot_mapping[rows:size] = self.scratch_slot
            self._block_tables[rows:size, 0] = self.scratch_block
            self._seq_lens[rows:size] = 1

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """[num_logits, vocab] logits for inputs.logits_indices rows, as the eager forward returns
        them, from the graph of the step's padded size; None when the step runs eagerly."""
        size = self.size_for(inputs)
        if size is None:
            return None
        self.fill(inputs, size)
        logits = self._graphs[size]()
        # the real rows' logits, in the order asked (the padding's are never read)
        return logits.index_select(0, inputs.logits_indices.to(logits.device, non_blocking=True))


def capture_cuda_graph(pool: object) -> Capture:
    """The CUDA capture: two warm-up runs first (Triton compiles its kernels, cuBLAS sets up its
    workspace, the caching allocator grows: none of it may happen under capture), then the capture
    into the shared memory pool. The warm-up runs on the current stream and the capture on
    torch.cuda.graph's one capture stream: a new side stream per load would get cuBLAS workspaces
    of its own, kept for the process, and load/unload cycles would not return to the same memory.
    thread_local: another model serving on another thread during a load (a hot-switch) is not an
    error of this capture. The replay returns the captured run's output tensor, which each replay
    overwrites."""

    def capture(step: Callable[[], torch.Tensor]) -> Replay:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def capture_decode_graphs(forward: Forward, *, max_batch_size: int, max_blocks_per_seq: int, scratch_block: int,
                          block_size: int, device: torch.device) -> DecodeGraphs:  # fmt: skip
    """DecodeGraphs captured on `device` (CUDA), logged with the time and memory they took."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)
    graphs = DecodeGraphs(forward, sizes=capture_sizes(max_batch_size), max_blocks_per_seq=max_blocks_per_seq,
                          scratch_block=scratch_block, block_size=block_size, device=device,
                          capture=capture_cuda_graph(torch.cuda.graph_pool_handle()))  # fmt: skip
    torch.cuda.synchronize(device)
    graphs.memory_bytes = torch.cuda.memory_reserved(device) - before
    log.info("captured decode graphs for batch sizes %s in %.2f s, %.1f MiB", graphs.sizes, graphs.capture_s,
             graphs.memory_bytes / 2**20)  # fmt: skip
    return graphs


def planned_graph_bytes(model_args, config, dtype: torch.dtype) -> int:
    """The decode graphs' memory for a model under `config` (0 where none are captured: not CUDA,
    graphs off, model parallel), their scratch KV block included: what the KV budget leaves them."""
    from engine.backends.base import FloatHeadLinear
    from engine.models.llama import kv_cache_bytes_per_block

    if config.device != "cuda" or not config.cuda_graphs or config.model_parallel_size != 1:
        return 0
    graphs = estimate_graph_bytes(dim=model_args.dim, ffn_hidden_dim=model_args.ffn_hidden_dim, vocab_size=model_args.vocab_size,
                                  max_rows=config.max_batch_size, dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                                  head_chunk_rows=FloatHeadLinear.CHUNK_ROWS)  # fmt: skip
    return graphs + kv_cache_bytes_per_block(model_args, 1, config.block_size_tokens, dtype)
