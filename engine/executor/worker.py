"""One model-parallel rank's share of a model: its weights, its KV cache, its forward pass.

The same code on rank 0 (engine.executor.worker_group.WorkerGroup) and on every follower (engine.executor.parallel).
dtype, device and backend are chosen from EngineConfig here, once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.backends import select_backend
from engine.loading.checkpoint import CheckpointSpec, load_rank_state_dict, nbytes_of
from engine.config import EngineConfig
from engine.loading.progress import Progress, ProgressCallback
from engine.models import model_class
from engine.models.llama import KVCache, Transformer, allocate_kv_caches, kv_cache_bytes_per_block
from engine.models.llama4.model import Llama4Transformer
from engine.models.llama4.vision import Llama4VisionEncoder
from engine.models.mllama.cache import CrossAttentionCache, state_bytes_per_image
from engine.models.mllama.model import MllamaTransformer
from engine.quant.cuda import to_device
from engine.quant.formats import ExpertWeights, QuantizedWeight
from engine.executor.step_inputs import StepInputs
from engine.executor.cross_attention import CrossAttentionUpdate
from engine.executor.cuda_graphs import DecodeGraphs, capture_decode_graphs, planned_graph_bytes
from engine.lora.adapters import LoraAdapter, read_adapter, shard_adapter
from engine.lora.layers import LoraSlots, attach_lora
from engine.types import CheckpointError, InvalidRequest

log = logging.getLogger(__name__)


def configured_kv_bytes_per_rank(config: EngineConfig, mp_size: int) -> int | None:
    """The KV cache bytes config fixes per rank; None on CUDA without kv_cache_bytes, where the
    executor takes a fraction of the memory free once the weights are loaded."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes // mp_size
    if config.device == "cuda":
        return None
    return config.cpu_kv_cache_bytes // mp_size


def plan_num_blocks(config: EngineConfig, *, bytes_per_block: int, budget_bytes: int, max_seq_len: int) -> int:
    """Blocks that fit the budget, never more than a full batch of full-length sequences uses."""
    useful = config.max_batch_size * math.ceil(max_seq_len / config.block_size_tokens)
    return min(budget_bytes // bytes_per_block, useful)


@dataclass
class Worker:
    """One model-parallel rank: its weights, its KV cache, its forward pass."""

    model: Transformer
    mp_size: int
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_seq_len: int
    weight_bytes: int  # this rank's weights in memory
    kv_caches: list[KVCache] | None = None
    rank: int = 0
    serves_lora: bool = False  # a Llama 2/3 model under max_loras > 0
    # LoRA adapters (engine/lora/): the loaded adapters and each adapted linear's part sizes; None
    # until the first adapter loads (the linears are wrapped then, so a model that never serves an
    # adapter runs exactly as before)
    lora: LoraSlots | None = None
    lora_sizes: dict[str, list[int]] | None = None
    # Llama 3.2 Vision: each sequence's cross-attention state, apart from the paged KV; None for text models
    cross_attention: CrossAttentionCache | None = None
    max_batch_size: int = 1
    # CUDA graphs for pure-decode steps (engine/executor/cuda_graphs.py): whether this rank captures
    # them once its KV cache is allocated (then one scratch block past the pool's), and the graphs
    cuda_graphs: bool = False
    decode_graphs: DecodeGraphs | None = None

    @classmethod
    def load(cls, spec: CheckpointSpec, config: EngineConfig, *, rank: int, device: torch.device, max_seq_len: int,
             progress: ProgressCallback | None = None) -> "Worker":
        with without_omp_team(device):
            return cls._load(spec, config, rank=rank, device=device, max_seq_len=max_seq_len, progress=progress)

    @classmethod
    def _load(cls, spec: CheckpointSpec, config: EngineConfig, *, rank: int, device: torch.device, max_seq_len: int,
              progress: ProgressCallback | None) -> "Worker":
        mp_size = config.model_parallel_size
        backend = select_backend(config, device)
        dtype = backend.dtype
        started_s = time.monotonic()
        state = _materialise(load_rank_state_dict(spec, rank, mp_size, progress=progress), device, dtype, rank, progress)
        with Progress(f"rank {rank}: preparing weights ({backend.name})", 1, unit="step", callback=progress, bar=False) as preparing:
            model = model_class(spec.model_args).from_state_dict(
                spec.model_args, state, backend, mp_size=mp_size, max_seq_len=max_seq_len, source=str(spec.checkpoint_dir)
            )
            preparing.update(1)
        del state
        weight_bytes = model.weight_bytes()
        log.info(
            "rank %d: %.1f MiB of weights on %s as %s%s, %s backend, in %.2f s",
            rank, weight_bytes / 2**20, device, dtype, f" ({config.quantization})" if config.quantization else "",
            backend.name, time.monotonic() - started_s,
        )  # fmt: skip
        serves_lora = config.max_loras > 0 and type(model) is Transformer
        cross = CrossAttentionCache(model) if isinstance(model, MllamaTransformer) else None
        # a Llama 2/3 model alone on a GPU whose backend's decode step reads no device tensor on the host,
        # its weights dense (the quantized CUDA linears are not checked under capture yet: issue #33)
        dense = len(model.weight_formats()) == 1
        graphs = (config.cuda_graphs and mp_size == 1 and type(model) is Transformer and dense
                  and backend.captures_decode_steps(dtype, spec.model_args.head_dim))  # fmt: skip
        return cls(model, mp_size, device, dtype, config.block_size_tokens, max_seq_len, weight_bytes, rank=rank,
                   serves_lora=serves_lora, cross_attention=cross, max_batch_size=config.max_batch_size,
                   cuda_graphs=graphs)  # fmt: skip

    def cross_attention_reserve_bytes(self, budget_bytes: int) -> int:
        """Bytes of the KV budget left to cross-attention states (Llama 3.2 Vision; 0 otherwise): one
        image at the most tiles per sequence of a full batch, at most half the budget (the 11B's
        states are ~0.2 GB an image in bf16: a full batch's would not fit a CPU's default budget).
        More images than that in flight use memory past the budget."""
        if self.cross_attention is None:
            return 0
        model = self.cross_attention.model
        per_image = state_bytes_per_image(model.params, self.mp_size, model.vision.dims.tokens_per_tile, self.dtype)
        return min(self.max_batch_size * per_image, budget_bytes // 2)

    @property
    def bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.model.params, self.mp_size, self.block_size, self.dtype)

    def plan_num_blocks(self, config: EngineConfig) -> int:
        """KV blocks this rank can hold: the configured bytes (split over the ranks), or a fraction
        of free accelerator memory, never more than a full batch of full-length sequences uses."""
        budget = configured_kv_bytes_per_rank(config, self.mp_size)
        if budget is None:  # CUDA: a fraction of what the weights left free, less what the decode graphs will take
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free_bytes * config.kv_cache_memory_fraction)
            if self.cuda_graphs:
                budget -= planned_graph_bytes(self.model.params, config, self.dtype)
        budget -= self.cross_attention_reserve_bytes(budget)
        num_blocks = plan_num_blocks(config, bytes_per_block=self.bytes_per_block, budget_bytes=budget,
                                     max_seq_len=self.max_seq_len)
        if num_blocks < 1:
            raise CheckpointError(
                f"KV cache budget of {budget} bytes per rank holds no block of {self.bytes_per_block} bytes; "
                "raise kv_cache_bytes"
            )
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """num_blocks for the block pool; with decode graphs one more, their padding rows' scratch
        block (never handed out), and the graphs captured over the allocated cache."""
        scratch = 1 if self.cuda_graphs else 0
        self.kv_caches = allocate_kv_caches(
            self.model.params, self.mp_size, num_blocks + scratch, self.block_size, dtype=self.dtype, device=self.device
        )
        if self.cuda_graphs:
            self.decode_graphs = capture_decode_graphs(
                lambda inputs: self.model(inputs, self.kv_caches), max_batch_size=self.max_batch_size,
                max_blocks_per_seq=math.ceil(self.max_seq_len / self.block_size), scratch_block=num_blocks,
                block_size=self.block_size, device=self.device,
            )  # fmt: skip
        blocks_per_seq = math.ceil(self.max_seq_len / self.block_size)
        if num_blocks < blocks_per_seq:
            log.warning(
                "KV cache holds %d tokens, less than one sequence of max_seq_len %d",
                num_blocks * self.block_size, self.max_seq_len,
            )  # fmt: skip

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        assert self.kv_caches is not None, "allocate_kv_cache first"
        if self.decode_graphs is not None and (logits := self.decode_graphs.run(inputs)) is not None:
            return logits
        cross = () if self.cross_attention is None else (self.cross_attention.for_step(),)
        if self.lora is None or inputs.lora_ids is None:
            return self.model(inputs.to(self.device), self.kv_caches, *cross)
        self.lora.begin_step(inputs)  # before the move: the runs are read from rank 0's CPU tensors
        try:
            return self.model(inputs.to(self.device), self.kv_caches, *cross)
        finally:
            self.lora.end_step()

    # ----------------------------------------------------------------- LoRA adapters
    def load_adapter(self, lora_id: int, adapter: LoraAdapter) -> int:
        """Install this rank's cut of an adapter under an engine lora id; bytes it holds here."""
        if not self.serves_lora:
            raise InvalidRequest(
                "this model serves no LoRA adapters (a Llama 4 model, or --max-loras 0)", param="lora_path",
                code="lora_disabled",
            )  # fmt: skip
        if self.lora is None or self.lora_sizes is None:  # the first adapter: wrap the linears now (weight_bytes is taken)
            self.lora = LoraSlots(kernels=self.model.backend.lora_kernels())  # the C kernel where the backend has it
            self.lora_sizes = attach_lora(self.model, self.lora)
        local = shard_adapter(adapter, self.model.params, self.rank, self.mp_size)
        return self.lora.install(lora_id, local, adapter.scale, self.lora_sizes, dtype=self.dtype, device=self.device)

    def load_adapter_from(self, lora_id: int, path: str, config: EngineConfig) -> int:
        """A follower's load: read the folder rank 0 checked already, then install this rank's cut."""
        return self.load_adapter(lora_id, read_adapter(Path(path), self.model.params, max_rank=config.max_lora_rank))

    def unload_adapter(self, lora_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_id)

    @property
    def image_encoder(self) -> Llama4VisionEncoder | None:
        """Llama 4's vision encoder (this rank's slice of its weights); None for other models."""
        return self.model.image_encoder if isinstance(self.model, Llama4Transformer) else None

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's tiles [chunks, 3, tile, tile] -> its rows [image tokens, dim], the same on every
        rank: every rank runs this at once (the encoder's collectives pair them up)."""
        assert self.image_encoder is not None, "a model without a vision encoder"
        return self.image_encoder(pixels.to(self.device))

    def update_cross_attention(self, update: CrossAttentionUpdate) -> None:
        """Drop and add sequences' cross-attention states, and set the next step's (rank 0's
        CrossAttentionTracker decided; every rank applies the same update)."""
        if self.cross_attention is None:
            raise RuntimeError("a cross-attention update for a model without cross-attention layers")
        self.cross_attention.apply(update.free_seq_ids, update.image_meta, update.pixels, update.step_seq_ids)


@contextlib.contextmanager
def without_omp_team(device: torch.device) -> Iterator[None]:
    """Run CPU loading work single-threaded, so the loading thread never starts an OpenMP team.

    The forward runs on the engine thread, usually not the thread that loaded the model. libgomp
    keeps a thread team per thread that ever ran a parallel region; once its managed threads
    outnumber the cores, every team spins only ~100 iterations before sleeping on a futex, and each
    of the ~120 parallel regions of a decode step pays a wake-up, nearly doubling a small model's
    batch-1 step (bench/NOTES.md). Loading single-threaded costs a little load time; the engine thread's team is then the only one."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _materialise(state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype, rank: int,
                 progress: ProgressCallback | None = None) -> dict[str, torch.Tensor]:
    """Read the mmapped weights into `dtype` on `device`, reporting bytes and rate (engine.loading.progress).
    Views of the shards stay zero-copy when dtype and device already match."""
    out = {}
    with Progress(f"rank {rank}: reading weights", sum(map(nbytes_of, state.values())), callback=progress) as reading:
        for key, value in state.items():
            # quantized weights (a quantized checkpoint) stay in their format; on CUDA their codes
            # move to the device (kernels per device: engine.quant.policy.check_formats)
            if isinstance(value, (QuantizedWeight, ExpertWeights)):
                out[key] = (value if device.type == "cpu" else to_device(value, device)).contiguous()
            else:
                out[key] = value.to(device=device, dtype=dtype).contiguous()
            reading.update(nbytes_of(value))
    return out
