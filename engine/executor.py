"""The model side of the engine: weights, the paged KV cache and model-parallel workers.

ModelExecutor runs on rank 0 and is what the runner drives: execute(StepInputs) -> logits.
RankShard is one rank's share (weights + KV cache + forward), the same code on rank 0 and on
every follower (engine/workers.py). dtype and device are read from EngineConfig here, once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.checkpoint import CheckpointSpec, check_parallel_size, load_rank_state_dict
from engine.config import EngineConfig
from engine.model import KVCache, Transformer, allocate_kv_caches, kv_cache_bytes_per_block
from engine.progress import Progress, ProgressCallback, tensor_bytes
from engine.cpu_kernels import load_cpu_kernels
from engine.cpu_kernels import supports as supports_cpu_kernels
from engine.quantization import check_quantization, pack_for_cpu, quantize_model
from engine.step_inputs import StepInputs
from engine.types import CheckpointError, EngineDead, InvalidRequest
from engine.workers import ParallelGroup, group_in_use, launched_by_torchrun, rank_device

log = logging.getLogger(__name__)


def torch_dtype(config: EngineConfig) -> torch.dtype:
    return getattr(torch, config.resolved_dtype())


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
class RankShard:
    """One model-parallel rank: its weights, its KV cache, its forward pass."""

    model: Transformer
    mp_size: int
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_seq_len: int
    weight_bytes: int  # this rank's weights in memory
    kv_caches: list[KVCache] | None = None

    @classmethod
    def load(cls, spec: CheckpointSpec, config: EngineConfig, *, rank: int, device: torch.device, max_seq_len: int,
             progress: ProgressCallback | None = None) -> "RankShard":
        with _without_omp_team(device):
            return cls._load(spec, config, rank=rank, device=device, max_seq_len=max_seq_len, progress=progress)

    @classmethod
    def _load(cls, spec: CheckpointSpec, config: EngineConfig, *, rank: int, device: torch.device, max_seq_len: int,
              progress: ProgressCallback | None = None) -> "RankShard":
        mp_size = config.model_parallel_size
        dtype = torch_dtype(config)
        started_s = time.monotonic()
        with torch.device("meta"):
            model = Transformer(spec.model_args, mp_size=mp_size, max_seq_len=max_seq_len)
        state = _materialise(load_rank_state_dict(spec, rank, mp_size, progress=progress), device, dtype, rank, progress)
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:  # shapes were checked against params.json; this is a bug guard
            raise CheckpointError(f"{spec.checkpoint_dir}: {exc}") from None
        del state
        quantize_model(model, config.quantization, mp_size)
        kernels = load_cpu_kernels() if device.type == "cpu" and config.cpu_kernels and supports_cpu_kernels(dtype) else None
        if device.type == "cpu":
            with Progress(f"rank {rank}: packing weights for the CPU", 1, unit="step", callback=progress, bar=False) as packing:
                if not pack_for_cpu(model, mp_size, dtype, kernels):
                    log.info("oneDNN weight packing unavailable for %s here; using F.linear", dtype)
                packing.update(1)
        model.init_rope(device, dtype)
        if kernels is not None:
            fused = model.use_cpu_kernels(kernels)
            log.info("rank %d: fused CPU kernels %s", rank, "on" if fused else "not usable by this model; torch path")
        model.eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        log.info(
            "rank %d: %.1f MiB of weights on %s as %s%s in %.2f s",
            rank, weight_bytes / 2**20, device, dtype, f" ({config.quantization})" if config.quantization else "",
            time.monotonic() - started_s,
        )  # fmt: skip
        return cls(model, mp_size, device, dtype, config.block_size_tokens, max_seq_len, weight_bytes)

    @property
    def bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.model.params, self.mp_size, self.block_size, self.dtype)

    def plan_num_blocks(self, config: EngineConfig) -> int:
        """KV blocks this rank can hold: the configured bytes (split over the ranks), or a fraction
        of free accelerator memory, never more than a full batch of full-length sequences uses."""
        budget = configured_kv_bytes_per_rank(config, self.mp_size)
        if budget is None:  # CUDA: a fraction of what the weights left free
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free_bytes * config.kv_cache_memory_fraction)
        num_blocks = plan_num_blocks(config, bytes_per_block=self.bytes_per_block, budget_bytes=budget,
                                     max_seq_len=self.max_seq_len)
        if num_blocks < 1:
            raise CheckpointError(
                f"KV cache budget of {budget} bytes per rank holds no block of {self.bytes_per_block} bytes; "
                "raise kv_cache_bytes"
            )
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(
            self.model.params, self.mp_size, num_blocks, self.block_size, dtype=self.dtype, device=self.device
        )
        blocks_per_seq = math.ceil(self.max_seq_len / self.block_size)
        if num_blocks < blocks_per_seq:
            log.warning(
                "KV cache holds %d tokens, less than one sequence of max_seq_len %d",
                num_blocks * self.block_size, self.max_seq_len,
            )  # fmt: skip

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        assert self.kv_caches is not None, "allocate_kv_cache first"
        return self.model(inputs.to(self.device), self.kv_caches)


@contextlib.contextmanager
def _without_omp_team(device: torch.device) -> Iterator[None]:
    """Run CPU loading work single-threaded, so the loading thread never starts an OpenMP team.

    The forward runs on the engine thread, usually not the thread that loaded the model. libgomp
    keeps a thread team per thread that ever ran a parallel region; once its managed threads
    outnumber the cores, every team spins only ~100 iterations before sleeping on a futex, and each
    of the ~120 parallel regions of a decode step pays a wake-up: the demo model's batch-1 step
    took 34-40 ms on the engine thread against 20 ms on the loading thread (2 cores). Loading
    single-threaded costs a little load time; the engine thread's team is then the only one."""
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
    """Read the mmapped weights into `dtype` on `device`, reporting bytes and rate (engine.progress).
    Views of the shards stay zero-copy when dtype and device already match."""
    out = {}
    with Progress(f"rank {rank}: reading weights", sum(map(tensor_bytes, state.values())), callback=progress) as reading:
        for key, value in state.items():
            out[key] = value.to(device=device, dtype=dtype).contiguous()
            reading.update(tensor_bytes(value))
    return out


class ModelExecutor:
    """Rank 0: loads weights, sizes and allocates the KV cache, starts and drives followers."""

    def __init__(self, spec: CheckpointSpec, config: EngineConfig, *, max_seq_len: int, progress: ProgressCallback | None = None) -> None:
        check_quantization(config.quantization)
        check_parallel_size(spec.model_args, config.model_parallel_size)
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.vocab_size = spec.model_args.vocab_size
        self.block_size = config.block_size_tokens
        self._group: ParallelGroup | None = None
        self._closed = False
        mp_size = config.model_parallel_size
        if mp_size > 1:
            if not launched_by_torchrun() and group_in_use():
                raise InvalidRequest(
                    "another model with model_parallel_size > 1 is loaded in this process; unload it first "
                    "(torch.distributed and fairscale keep one model-parallel group per process)",
                    param="model_parallel_size",
                    code="model_parallel_busy",
                )
            if launched_by_torchrun():
                self._group = ParallelGroup.join_launched(config)
            else:
                self._group = ParallelGroup.spawn(config, spec, max_seq_len=max_seq_len)
        try:
            device = self._group.device if self._group else rank_device(config, 0)
            with _without_omp_team(device):  # the KV cache's zero fill too
                self._shard = RankShard.load(spec, config, rank=0, device=device, max_seq_len=max_seq_len, progress=progress)
                num_blocks = self._shard.plan_num_blocks(config)
                if self._group is not None:
                    num_blocks = self._group.agree_min(num_blocks)
                self._shard.allocate_kv_cache(num_blocks)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = num_blocks
        self.weight_bytes = self._shard.weight_bytes * mp_size  # all ranks (norms are replicated: close enough)
        self.kv_cache_bytes = num_blocks * self._shard.bytes_per_block * mp_size
        log.info(
            "executor ready: %d KV blocks of %d tokens (%.1f MiB), weights %.1f MiB, model_parallel_size %d",
            num_blocks, self.block_size, self.kv_cache_bytes / 2**20, self.weight_bytes / 2**20, mp_size,
        )  # fmt: skip

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """[num_logits, vocab] float32 logits on the CPU, for inputs.logits_indices rows."""
        if self._closed:
            raise EngineDead("the model executor was shut down")
        if self._group is None:
            return self._shard.forward(inputs).cpu()
        self._group.broadcast_step(inputs)
        return self._group.collective(lambda: self._shard.forward(inputs)).cpu()

    def shutdown(self) -> None:
        """Stop followers and free the process group; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._group is not None:
            self._group.shutdown()
            self._group = None
